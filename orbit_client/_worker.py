"""Workers: lease tasks from a queue, run their handlers, heartbeat, report the outcome.

:class:`Worker` (:mod:`._thread_worker`) runs handlers in a thread pool; :class:`AsyncWorker`
(:mod:`._async_worker`) runs coroutine handlers on an asyncio loop. Both share the non-I/O parts
here: the handler's context and errors, the checked configuration, and :class:`_WorkerCore`, the
rules of each step of a task (lease, run, report, heartbeat) apart from how a worker waits. Both follow the long-running-loop habits of the house style: ``run()`` /
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

import logging
import os
import random
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orbit_client import _tracing
from orbit_client._attempt_models import AttemptError, AttemptState, LeaseGrant
from orbit_client._exceptions import LeaseLostError, OrbitError, OrbitUsageError
from orbit_client._metrics import WorkerMetrics, release_server, serve
from orbit_client._pipeline import START_WITHIN, Held, Pipeline, default_prefetch
from orbit_client._task_models import Task

__all__ = ["RetryableError", "TaskCancelled", "TaskContext"]

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
        "task %s (%s) attempt %s (generation %d) failed: %s: %s%s",
        task.id, task.handler, attempt_id, generation, error.type, error.message, retry_note(error),
        exc_info=exc,
    )  # fmt: skip


#: Error types the worker reports itself (not a handler's exception): raising RetryableError is no remedy.
_WORKER_ERRORS = frozenset({"cancelled", "unknown_handler", "invalid_result"})


def retry_note(error: AttemptError) -> str:
    """What becomes of a failed attempt, for a log line: ``"; not retried: raise RetryableError to retry"``
    for a handler's exception that is not retryable (README "Workers"), ``"; retryable"`` for one that is,
    ``""`` for an error the worker reported itself."""
    if error.type in _WORKER_ERRORS:
        return ""
    return (
        "; retryable (another attempt if any are left)"
        if error.retryable
        else ("; not retried: raise RetryableError to retry")
    )


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
        prefetch: int | None = None,
        lease_and_start: bool = True,
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
        if prefetch is not None and (isinstance(prefetch, bool) or not 0 <= prefetch <= 10_000):
            raise OrbitUsageError(f"prefetch must be None or 0-10000, not {prefetch!r}")
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
        #: Most grants held beyond the slots (orbit_client._pipeline); fewer when handlers are slow.
        self.prefetch_cap = default_prefetch(concurrency) if prefetch is None else prefetch
        self.lease_and_start = bool(lease_and_start)
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
    """An attempt the heartbeats renew: while its handler runs, and after it returned (``done``)
    until its report is answered, so that a report waiting out its linger (or retried) keeps its
    lease. A ``lease_lost`` answer for a ``done`` attempt is no loss: its report decides (the
    report may have won the race with the heartbeat)."""

    grant: LeaseGrant
    ctx: TaskContext
    next_beat: float
    done: bool = False


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
            queue. ``None`` (the default) counts nothing. Needs ``pip install 'orbit-tasks[metrics]'``
            (prometheus-client); README "Operations".
        metrics_host: address the metrics server listens on. Default ``"127.0.0.1"``.
        prefetch: most grants held beyond ``concurrency``, waiting for a slot; the worker holds
            fewer when its handlers are slow, so that each grant starts within a quarter of its
            lease (README "Workers"). ``None`` (the default) means four times ``concurrency``,
            and at least 16 (few slots with short handlers run through four grants before the
            report batch carrying the next ones is answered); ``0`` leases only for free slots.
        lease_and_start: ask for grants already ``RUNNING`` (lease-and-start: no ``start`` call;
            the attempt's first heartbeat or report confirms it, and one never confirmed lapses
            as never started) when the server offers it (``GET /v1/settings``). Default ``True``;
            ``False`` confirms every start with its own (batched) call after the lease.

    Raises:
        OrbitUsageError: an argument is out of range, or ``metrics_port`` is set and
            prometheus-client is not installed.
"""


class _WorkerCore:
    """What :class:`Worker` and :class:`AsyncWorker` share and that does no I/O: the checked
    configuration, the attempts in flight, and the rules for each step of a task (lease, run,
    report, heartbeat) apart from how they wait. Each worker writes its own loops over these.
    """

    #: What the worker holds (set by each worker's ``__init__``).
    _pipe: Pipeline

    def __init__(self, config: _Config, *, install_signal_handlers: bool) -> None:
        self._config = config
        self._metrics = config.metrics
        self._metrics_bound: int | None = None
        self._install_signal_handlers = install_signal_handlers
        #: The attempts whose handler runs, by attempt id: the heartbeats renew their leases.
        self._active: dict[str, _Active] = {}
        #: Leased tasks with a handler whose start is not answered yet (the start batch waits for them).
        self._starting = 0
        #: Whether the last lease answer granted fewer tasks than it asked for: nothing more was due.
        self._drained = False
        #: Slots inside their start call (``start`` sent or about to be), for the start batch's linger.
        self._in_start = 0
        #: Whether batched reports name their attempt's task (the server's ``item_task_ids``).
        self._item_task_ids = False

    def _named_task(self, grant: LeaseGrant) -> str | None:
        """The task id a batched ``start``/``complete`` report names (``StartItem.task_id``), when the server
        takes it: it then locks the batch's tasks without reading which they are first."""
        return grant.task.id if self._item_task_ids else None

    def _may_start(self) -> int:
        """How many ``start`` reports may still join a forming start batch (its ``enough``): the
        leased tasks not yet started, but no more than the slots not running a handler. A slot
        busy in a handler sends no start until it returns, and a grant waiting in hand none until
        a slot takes it: counting them kept every start batch lingering its whole
        ``report_linger`` (``bench.workers``: 44 → 102 tasks/s at concurrency 1, 1.3× at 4)."""
        return min(self._starting, self._config.concurrency - (self._pipe.running - self._in_start))

    def _may_report(self) -> int:
        """What a forming ``complete``/``fail`` batch waits for (its ``busy``; it leaves at 0 or at the
        linger's end): the handlers running or starting and the reports handed off that have not joined
        one yet.

        At concurrency 1 the only report that can join is the one slot's *next* task's, a start's round
        trip and a whole handler away. While handlers are shorter on average than ``report_linger`` it
        comes within the linger and is waited for: batching the two halves the calls
        (``bench.timeline``'s backlog round with instant handlers: a report sent at once met the next
        start on the server and slowed it, 98-116 → 49-96 tasks/s). With longer handlers the batch
        waits only for a start under way, so that it does not meet that start on the server, and then
        leaves; before, it waited out the whole linger for a report that could not come.
        """
        pipe = self._pipe
        if pipe.concurrency == 1:
            linger = self._config.report_linger or 0.0
            if pipe.mean is None or pipe.mean >= linger:
                return pipe.handing + self._in_start
        return pipe.may_report()

    #: Set by each worker: whether report batches may carry leases (report-and-lease offered and on),
    #: and the running mean of report batches' round trips, in seconds (``None``: none answered yet).
    _riding: bool
    _report_rtt: float | None

    def _quick_reports(self) -> bool:
        """Whether report answers come back fast enough to carry grants: within a quarter lease
        (a grant travelling back longer would be a grant waiting longer; module docstring of
        :mod:`orbit_client._pipeline`). Unknown until one report batch was answered: no ride."""
        rtt = self._report_rtt
        return rtt is not None and rtt <= START_WITHIN * self._config.lease_seconds

    def _lease_after_reports(self) -> bool:
        """Whether a standalone lease request waits for the reports on their way to be answered.

        While tasks are due, a ``complete``/``fail`` batch carries the lease (report-and-lease: one
        call fewer). Once a lease came back short (``_drained``: nothing more was due) a carried lease
        would find nothing and could not wait, and the long poll would follow anyway: no report carries
        one then, and the long poll leaves once the reports are answered, so that it does not meet
        them on the server (``bench.timeline``'s trickle round: a carried lease made each complete
        slower and each task cost one more claim)."""
        if self._drained:
            return True
        return self._riding and self._quick_reports()

    def _needs_start(self, held: Held) -> bool:
        """Whether the grant a slot just took needs a ``start`` call before its handler runs; if so the
        slot counts it in ``_in_start`` until the start is answered (``held.confirming``)."""
        held.confirming = not held.started and held.grant.task.handler in self._config.handlers
        return held.confirming

    def _starts_first(self) -> bool:
        """Whether a standalone lease request waits for the starts under way: while a free slot is
        taking a grant in hand, and while every slot is confirming the start of its grant (no handler
        runs). The start is on the task's path and the lease then only refills what the worker holds
        beyond its slots: sent first, it took the interpreter (or event loop) and the server ahead of
        the start (``bench.timeline`` at concurrency 1: the next lease left 0.3-0.9 ms before the start,
        which then waited behind it). Bounded by one start's round trip; a report batch may still
        carry the lease meanwhile (report-and-lease)."""
        pipe = self._pipe
        if pipe.waiting and pipe.running < pipe.concurrency:
            return True
        return 0 < pipe.running == self._in_start

    @property
    def worker_id(self) -> str:
        """The id this worker leases under."""
        return self._config.worker_id

    @property
    def metrics_port(self) -> int | None:
        """The port metrics are served on while :meth:`run` runs (else the one asked for; ``None``: none)."""
        return self._metrics_bound if self._metrics_bound is not None else self._config.metrics_port

    def __repr__(self) -> str:
        c = self._config
        return (
            f"{type(self).__name__}(namespace={c.namespace!r}, queue={c.queue!r}, worker_id={c.worker_id!r})"
        )

    def _release_metrics(self) -> None:
        if self._metrics_bound is not None:
            release_server(self._config.metrics_host, self._metrics_bound)
            self._metrics_bound = None

    # --- lease ---------------------------------------------------------------------------------------

    def _lease_arguments(self, free: int) -> dict[str, Any]:
        """Keyword arguments of ``lease_tasks`` for ``free`` slots."""
        config = self._config
        return {
            "worker_id": config.worker_id,
            "max_tasks": min(free, _MAX_LEASE),
            "lease_seconds": config.lease_seconds,
            "wait_seconds": config.poll_wait_seconds,
        }

    def _lease_failed(self, exc: OrbitError, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed lease call in a row; raise ``exc`` when
        retrying cannot help (401, 403, 404)."""
        if not exc.retryable:
            raise exc
        delay = self._config.backoff(failures)
        logger.warning("lease call failed (%s); retrying in %.2f s", type(exc).__name__, delay)
        return delay

    def _lease_call_broke(self, exc: BaseException, sent_at: float) -> None:
        """A lease call sent at ``sent_at`` ended with ``exc``, not an :class:`OrbitError` (cancelled, a bug, an
        error the client does not translate): the request is no longer outstanding, so the drain must not wait
        for its answer (grants it may have made lapse unstarted on the server); an ``Exception`` is logged. The
        caller re-raises ``exc``: ``run()`` stops and raises it."""
        self._took([], sent_at)
        if isinstance(exc, Exception):
            logger.exception("unexpected error in the lease loop; worker %s stopping", self._config.worker_id)

    def _took(self, grants: list[LeaseGrant], sent_at: float) -> None:
        """Take the answer to the outstanding lease request (each worker's own: under its lock, or on its loop)."""
        raise NotImplementedError

    def _leased(self, grants: list[LeaseGrant]) -> int:
        """Count a lease answer; how many of its tasks have a handler here (they will start)."""
        if self._metrics is not None:
            self._metrics.leased(len(grants))
        return sum(grant.task.handler in self._config.handlers for grant in grants)

    # --- run -----------------------------------------------------------------------------------------

    def _unknown_handler_error(self, grant: LeaseGrant) -> AttemptError:
        """The failure of a task whose handler this worker does not have (logged)."""
        config, task, attempt = self._config, grant.task, grant.attempt
        error = _unknown_handler(config.worker_id, task.handler, config.handlers)
        logger.warning(
            "task %s attempt %s (generation %d) failed: %s",
            task.id,
            attempt.id,
            attempt.generation,
            error.message,
        )
        return error

    def _running_attempt(self, grant: LeaseGrant) -> _Active:
        """The started attempt, as the heartbeats see it (its first beat a third of a lease away)."""
        config = self._config
        return _Active(grant, config.context(grant), time.monotonic() + config.heartbeat_interval)

    def _handler_ran(self, handler: str, began: float) -> None:
        if self._metrics is not None:
            self._metrics.handler_ran(handler, time.monotonic() - began)

    def _handler_failed(self, grant: LeaseGrant, exc: Exception) -> AttemptError:
        """The failure report of a handler that raised ``exc`` (logged, and on the span)."""
        error = _error_for(exc)
        if _tracing.AVAILABLE:
            _tracing.handler_failed(exc, error.type)
        _log_failure(grant.task, grant.attempt.id, grant.attempt.generation, exc, error)
        return error

    @staticmethod
    def _invalid_result(grant: LeaseGrant, exc: OrbitUsageError) -> AttemptError:
        """The failure report of a handler whose result cannot be sent (not JSON; logged)."""
        error = AttemptError(type="invalid_result", message=str(exc)[:_MESSAGE_MAX], retryable=False)
        logger.warning(
            "task %s attempt %s (generation %d) failed: invalid_result: %s",
            grant.task.id,
            grant.attempt.id,
            grant.attempt.generation,
            error.message,
        )
        return error

    # --- report --------------------------------------------------------------------------------------

    def _report_give_up_at(self) -> float:
        """Monotonic time after which a report is no longer retried: one lease from now."""
        return time.monotonic() + self._config.lease_seconds

    def _reported(self, state: AttemptState) -> None:
        if self._metrics is not None:
            self._metrics.reported(state.task_status)

    def _report_failed(
        self, grant: LeaseGrant, exc: OrbitError, failures: int, give_up: float
    ) -> float | None:
        """Seconds to wait before sending a failed report again, or ``None`` to give it up (logged).

        A lost lease is not retried (another attempt may own the task); nor is a failure that is not
        retryable, nor one after ``give_up`` (a monotonic time).
        """
        if isinstance(exc, LeaseLostError):
            if self._metrics is not None:
                self._metrics.lease_lost()
            logger.warning(
                "task %s attempt %d lost its lease before reporting (evidence kept: %s)",
                grant.task.id,
                grant.attempt.generation,
                exc.evidence_recorded,
            )
            return None
        if not exc.retryable or time.monotonic() >= give_up:
            logger.error(
                "could not report task %s attempt %d: %s", grant.task.id, grant.attempt.generation, exc
            )
            return None
        return self._config.backoff(failures)

    # --- heartbeat -----------------------------------------------------------------------------------

    @property
    def _heartbeat_tick(self) -> float:
        """Seconds between looks for due heartbeats."""
        return min(0.1, self._config.heartbeat_interval / 4)

    def _due_heartbeats(self) -> list[_Active]:
        now = time.monotonic()
        return [a for a in self._active.values() if a.next_beat <= now]

    def _heartbeat_answered(
        self, active: _Active, outcome: AttemptState | OrbitError, forget: Callable[[str], bool]
    ) -> None:
        """Apply one heartbeat's answer: schedule the next beat, or signal the handler to stop.

        ``forget(attempt_id)`` drops the attempt from the active ones and says whether it was still
        there (``False``: it finished while the heartbeat was on its way, so its lease is not lost).
        """
        config, attempt = self._config, active.grant.attempt
        if isinstance(outcome, LeaseLostError):
            if not active.done and forget(attempt.id):
                if self._metrics is not None:
                    self._metrics.lease_lost()
                logger.warning("task %s attempt %d lost its lease", active.grant.task.id, attempt.generation)
                active.ctx._lost.set()
            return
        if isinstance(outcome, OrbitError):
            if self._metrics is not None:
                self._metrics.heartbeat_failed()
            logger.warning("heartbeat of task %s failed (%s); retrying", active.grant.task.id, outcome)
            active.next_beat = time.monotonic() + min(1.0, config.heartbeat_interval / 2)
            return
        active.next_beat = time.monotonic() + config.heartbeat_interval
        if outcome.cancel_requested and not active.ctx._cancel.is_set():
            logger.info("cancellation requested for task %s", active.grant.task.id)
            active.ctx._cancel.set()
