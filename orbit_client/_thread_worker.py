"""The thread worker: :class:`Worker`, pipelined (DESIGN §4 "Pipelined worker"; :mod:`._pipeline`).

Threads: the caller's (``run()``) keeps the next lease request outstanding; ``concurrency`` slot
threads each take the next grant in hand, confirm its start when the server did not grant it
``RUNNING``, run its handler, and hand the outcome to a reporter thread before taking the next
grant, so a slot never waits for a report; the reporter threads coalesce the reports
(:class:`~orbit_client._reports.Reports`), and a ``complete``/``fail`` batch carries the next
lease request when one is wanted and none is outstanding (report-and-lease); one heartbeat thread
renews the running attempts (and those whose report is on its way), and the grants waiting past
a quarter of their lease. Its rules are shared with :class:`AsyncWorker` in :mod:`._worker`.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any

from orbit_client import _tracing
from orbit_client._attempt_models import AttemptState, BatchLease, LeaseGrant
from orbit_client._client import OrbitClient
from orbit_client._exceptions import LeaseLostError, NotFoundError, OrbitError, OrbitUsageError
from orbit_client._pipeline import Held, Pipeline
from orbit_client._reports import Reports
from orbit_client._worker import (
    _DOC_ARGS,
    DEFAULT_THREAD_REPORT_LINGER,
    TaskContext,
    _Active,
    _Config,
    _WorkerCore,
    logger,
)

__all__ = ["Worker"]


class Worker(_WorkerCore):
    """Run handlers for a queue's tasks in a thread pool, until :meth:`stop` (or SIGTERM).

    Each task: ``handler(ctx)`` in one of ``concurrency`` slot threads, with heartbeats every third
    of the lease from a separate thread, then ``complete`` with the returned JSON value, or
    ``fail`` when the handler raised (``retryable`` per :class:`RetryableError`; type
    ``"cancelled"`` per :class:`TaskCancelled`). Reports are retried by the client: the server
    answers a repeated report with the same body alike.

    Pipelined (README "Workers"): the next lease request is outstanding while handlers run, so a
    slot freed by a handler takes the next grant in hand at once; the worker holds at most as many
    grants as it can start within a quarter of their lease (a waiting grant past that is
    heartbeated, never left to expire, and one whose lease may have lapsed is never started).
    Against a server that offers them (``GET /v1/settings``), grants come back already ``RUNNING``
    (*lease-and-start*: confirmed by the attempt's first heartbeat or report; an answer lost on
    the way is safe, its attempts lapse as never started), and a ``complete``/``fail`` batch
    carries the lease request for the slots it frees (*report-and-lease*). Otherwise each start is
    confirmed by its own (batched) report after the lease, as before.

    The ``start``, ``complete`` and ``fail`` reports made within ``report_linger`` of each other
    travel as one batched call per kind, split below the server's body limit, and the heartbeats
    due together as one; each report still gets its own outcome, so a ``lease_lost`` reaches its
    own task only.
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
        prefetch: int | None = None,
        lease_and_start: bool = True,
    ) -> None:
        for name, fn in handlers.items():
            if inspect.iscoroutinefunction(fn):
                raise OrbitUsageError(f"handler {name!r} is a coroutine function; use AsyncWorker for it")
        config = _Config(
            namespace, queue, handlers, concurrency=concurrency, lease_seconds=lease_seconds,
            poll_wait_seconds=poll_wait_seconds, shutdown_timeout=shutdown_timeout, worker_id=worker_id,
            error_backoff_cap=error_backoff_cap, report_linger=report_linger, metrics_port=metrics_port,
            metrics_host=metrics_host, prefetch=prefetch, lease_and_start=lease_and_start,
        )  # fmt: skip
        super().__init__(config, install_signal_handlers=install_signal_handlers)
        self._client = client
        self._stopping = threading.Event()
        self._lock = threading.Condition()
        self._pipe = Pipeline(config.concurrency, config.lease_seconds, config.prefetch_cap)
        #: Set by :meth:`run` from the server's settings: grants come back RUNNING / reports carry leases.
        self._start_on_lease = False
        self._riding = False
        #: Running mean of report batches' round trips, in seconds (``None``: none answered yet).
        self._report_rtt: float | None = None
        self._reports = self._new_reports(body_limit=None)

    def _new_reports(self, body_limit: int | None) -> Reports:
        return Reports(
            self._client, self._config.namespace, linger=self._config.report_linger,
            in_flight=lambda: self._pipe.running + self._pipe.reporting, starting=self._may_start,
            rider=self if self._riding else None, body_limit=body_limit, busy=self._may_report,
        )  # fmt: skip

    def stop(self) -> None:
        """Ask :meth:`run` to stop: no new leases; running handlers and grants in hand finish (thread-safe, idempotent)."""
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
            Exception: any other exception out of a lease call (not an :class:`OrbitError`: a bug,
                an error the client does not translate) is logged and stops the worker as
                :meth:`stop` does; ``run()`` raises it once the running handlers finished (within
                ``shutdown_timeout``). Grants the failed call may have made lapse unstarted.
        """
        config = self._config
        self._stopping.clear()
        beat_stop = threading.Event()
        beater = threading.Thread(target=self._heartbeat_loop, args=(beat_stop,), name="orbit-heartbeat",
                                  daemon=True)  # fmt: skip
        # One reporter thread per grant the worker may hold: a report never waits for a thread.
        reporters = ThreadPoolExecutor(
            max_workers=config.concurrency + config.prefetch_cap + 1, thread_name_prefix="orbit-report"
        )
        slots = [
            threading.Thread(target=self._slot, args=(reporters,), name=f"orbit-handler-{n}", daemon=True)
            for n in range(config.concurrency)
        ]
        logger.info("worker %s serving %s/%s", config.worker_id, config.namespace, config.queue)
        try:
            self._metrics_bound = config.serve_metrics()
            with self._signals():
                if self._learn_server():
                    beater.start()
                    for slot in slots:
                        slot.start()
                    self._lease_loop()
        finally:
            self._stopping.set()
            with self._lock:
                self._lock.notify_all()
            self._drain(slots)
            reporters.shutdown(wait=False)
            beat_stop.set()
            if beater.is_alive():
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

    def _learn_server(self) -> bool:
        """Read what the server offers (``GET /v1/settings``), retrying like a lease; ``False`` if stopped."""
        failures = 0
        while not self._stopping.is_set():
            try:
                features = self._client.get_settings()
            except NotFoundError:
                features = None  # a server without /v1/settings: none of the newer calls either
            except OrbitError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                delay = self._config.backoff(failures)
                logger.warning("could not read the server's settings (%s); retrying in %.2f s", exc, delay)
                self._stopping.wait(delay)
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
        """A lease request for a ``complete``/``fail`` batch of ``reports`` to carry, or ``None``."""
        config, pipe = self._config, self._pipe
        with self._lock:
            if pipe.asking or self._stopping.is_set() or not self._quick_reports() or self._drained:
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
        """The grants of a riding lease request (``None``: none, ``error`` says why)."""
        if error is not None and not isinstance(error, OrbitError | BaseException):
            logger.warning("the lease carried by a report batch was refused: %s", error)
        self._took(grants or [], sent_at)

    def _took(self, grants: list[LeaseGrant], sent_at: float) -> None:
        """The answer to the outstanding lease request: it is no longer outstanding, whatever fails here."""
        config = self._config
        with self._lock:
            try:
                self._drained = len(grants) < self._pipe.asked
                self._pipe.hold(grants, sent_at)
                self._starting += sum(
                    grant.task.status != "RUNNING" and grant.task.handler in config.handlers
                    for grant in grants
                )
            finally:
                self._pipe.asking, self._pipe.asked = False, 0
                self._lock.notify_all()
        if self._metrics is not None and grants:
            self._metrics.leased(len(grants))

    def _lease_loop(self) -> None:
        config, pipe = self._config, self._pipe
        failures = 0
        while not self._stopping.is_set():
            with self._lock:
                # Reports on their way carry the next lease request (report-and-lease): wait for them.
                while not self._stopping.is_set() and (
                    pipe.asking
                    or pipe.want() <= 0
                    or (pipe.reporting > 0 and self._lease_after_reports())
                    or self._starts_first()
                ):
                    self._lock.wait()
                if self._stopping.is_set():
                    return
                want = pipe.want()
                pipe.asking, pipe.asked = True, want
            sent_at = time.monotonic()
            try:
                grants = self._client.lease_tasks(
                    config.namespace, config.queue, worker_id=config.worker_id, max_tasks=want,
                    lease_seconds=config.lease_seconds, wait_seconds=config.poll_wait_seconds,
                    **({"start": True} if self._start_on_lease else {}),
                )  # fmt: skip
            except OrbitError as exc:
                self._took([], sent_at)
                failures += 1
                self._stopping.wait(self._lease_failed(exc, failures))
                continue
            except BaseException as exc:  # a bug, an untranslated error, KeyboardInterrupt
                self._lease_call_broke(exc, sent_at)
                raise
            failures = 0
            self._took(grants, sent_at)

    def _drain(self, slots: list[threading.Thread]) -> None:
        timeout = self._config.shutdown_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        pipe = self._pipe
        with self._lock:
            while pipe.held or pipe.asking:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    logger.warning(
                        "shutdown_timeout passed with %d tasks still held; their leases will lapse", pipe.held
                    )
                    return
                if not any(slot.is_alive() for slot in slots) and not pipe.running and pipe.waiting:
                    pipe.waiting.clear()  # never started (the slots did not start): they lapse unstarted
                    continue
                self._lock.wait(remaining if remaining is not None else 0.5)

    def _slot(self, reporters: ThreadPoolExecutor) -> None:
        pipe = self._pipe
        while True:
            with self._lock:
                while not pipe.waiting and not (self._stopping.is_set() and not pipe.asking):
                    self._lock.wait()
                held, lapsed = pipe.next()
                if held is not None:
                    pipe.running += 1
                    self._in_start += self._needs_start(held)
                for gone in lapsed:
                    self._starting -= not gone.started and gone.grant.task.handler in self._config.handlers
                self._lock.notify_all()
            for gone in lapsed:
                logger.warning(
                    "task %s attempt %d waited past its lease for a slot; not started (it lapses unstarted)",
                    gone.grant.task.id, gone.grant.attempt.generation,
                )  # fmt: skip
            if held is None:
                if lapsed:
                    continue
                return
            try:
                self._execute(held, reporters)
            finally:
                with self._lock:
                    if held.confirming:  # its start was never reached (an unexpected error)
                        self._in_start -= 1
                        held.confirming = False
                    self._free(held)

    def _execute(self, held: Held, reporters: ThreadPoolExecutor) -> None:
        grant = held.grant
        try:
            if _tracing.AVAILABLE:
                with _tracing.use_span(_tracing.run_span(grant, self._config.worker_id)):
                    self._run_one(held, reporters)
            else:
                self._run_one(held, reporters)
        except Exception:  # never let one task kill the slot thread silently
            logger.exception("unexpected error while running task %s", grant.task.id)
            with self._lock:
                self._active.pop(grant.attempt.id, None)

    def _hand_off(self, reporters: ThreadPoolExecutor, grant: LeaseGrant, send: Callable[[], None]) -> None:
        """Count the report as on its way and send it from a reporter thread (the slot moves on)."""
        with self._lock:
            self._pipe.reporting += 1
            self._pipe.handing += 1

        def report() -> None:
            with self._lock:
                self._pipe.handing -= 1  # joins its batch now (Pipeline.may_report)
            try:
                send()
            except Exception:
                logger.exception("unexpected error while reporting task %s", grant.task.id)
            finally:
                with self._lock:
                    self._active.pop(grant.attempt.id, None)
                    self._pipe.reporting -= 1
                    self._lock.notify_all()

        # In this slot thread's context: the report's trace span is a child of the task's run span.
        reporters.submit(contextvars.copy_context().run, report)

    def _run_one(self, held: Held, reporters: ThreadPoolExecutor) -> None:
        config, reports = self._config, self._reports
        grant = held.grant
        task, attempt = grant.task, grant.attempt
        handler = config.handlers.get(task.handler)
        if handler is None:
            error = self._unknown_handler_error(grant)
            self._hand_off(
                reporters, grant, lambda: self._report(grant, lambda: reports.fail(attempt, error))
            )
            return
        if not held.started:  # counted in _in_start by _slot (_needs_start)
            try:
                reports.start(attempt, self._named_task(grant))
            except OrbitError as exc:
                logger.warning("could not start task %s attempt %d: %s", task.id, attempt.generation, exc)
                return
            finally:
                with self._lock:
                    self._starting -= 1
                    self._in_start -= held.confirming
                    held.confirming = False
                    self._lock.notify_all()  # a lease deferred behind this start may go (_starts_first)
                reports.wake()  # and a report waiting for it (_may_report)
        ctx = config.context(grant)
        with self._lock:
            self._active[attempt.id] = _Active(grant, ctx, self._first_beat(held))
        logger.debug("running task %s (%s) attempt %d", task.id, task.handler, attempt.generation)
        began = time.monotonic()
        try:
            result = handler(ctx)
        except Exception as exc:
            self._ran(held, began)
            error = self._handler_failed(grant, exc)
            self._hand_off(
                reporters, grant, lambda: self._report(grant, lambda: reports.fail(attempt, error))
            )
            return
        self._ran(held, began)
        self._hand_off(reporters, grant, lambda: self._complete(grant, result))

    def _ran(self, held: Held, began: float) -> None:
        """The handler returned: its slot is free; its heartbeats go on until its report is answered,
        and a lease_lost they meet from now on is no loss (:class:`_Active`)."""
        seconds = time.monotonic() - began
        with self._lock:
            active = self._active.get(held.grant.attempt.id)
            if active is not None:
                active.done = True
            self._free(held)
            self._pipe.observe(seconds)
        if self._metrics is not None:
            self._metrics.handler_ran(held.grant.task.handler, seconds)

    def _free(self, held: Held) -> None:
        """Give ``held``'s slot back (once; under the lock)."""
        if not held.freed:
            held.freed = True
            self._pipe.running -= 1
            self._lock.notify_all()

    def _complete(self, grant: LeaseGrant, result: Any) -> None:
        reports, attempt = self._reports, grant.attempt
        try:
            self._report(grant, lambda: reports.complete(attempt, result, self._named_task(grant)))
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
        config = self._config
        while not stop.wait(self._heartbeat_tick):
            now = time.monotonic()
            with self._lock:
                due = [a for a in self._active.values() if a.next_beat <= now]
                overdue = self._pipe.overdue(now)
            if not due and not overdue:
                continue
            sent_at = time.monotonic()
            outcomes = self._reports.heartbeats(
                [active.grant.attempt for active in due] + [held.grant.attempt for held in overdue]
            )
            for held, outcome in zip(overdue, outcomes[len(due) :], strict=True):
                with self._lock:
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
        with self._lock:
            return self._active.pop(attempt_id, None) is not None
