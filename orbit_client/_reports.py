"""How the workers send their attempt reports: coalesced into batched calls, or one call each.

A worker's handlers report ``start``, ``complete`` and ``fail`` from many threads (or tasks)
at about the same time. With a ``report_linger`` the reports of one kind made within that
many seconds travel as one batched call (``POST .../attempts/start`` etc., DESIGN §4
"Batched attempt calls"); the first report of a batch waits at most ``report_linger``, and
less when as many reports are waiting as the worker has tasks in flight (no more can come).
Heartbeats are due together already: the heartbeat loop sends those due in one call.

Each report still gets its own outcome: an item's ``409 lease_lost`` raises
:class:`LeaseLostError` in the thread that made that report, exactly as the single call
does. A failure of the batch request as a whole (after the client's own retries) is raised
in every thread whose report was in it, as the single call's failure would have been.

A server without the batched calls answers ``404 not_found`` for their routes; the reports
then fall back to single calls for good (logged once).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Generic, TypeVar

from pydantic import BaseModel, JsonValue

from orbit_client import _tracing
from orbit_client._attempt_models import (
    MAX_ATTEMPT_BATCH_ITEMS,
    AttemptError,
    AttemptItemResult,
    AttemptLease,
    AttemptState,
    CompleteItem,
    FailItem,
    HeartbeatItem,
    StartItem,
)
from orbit_client._calls import _model
from orbit_client._client import AsyncOrbitClient, OrbitClient
from orbit_client._exceptions import NotFoundError, OrbitError

__all__ = ["AsyncReports", "Reports"]

logger = logging.getLogger("orbit_client.worker")

_Item = TypeVar("_Item", bound=BaseModel)
_T = TypeVar("_T")


class _Unsupported(Exception):
    """The server has no batched calls: send this report on its own."""


def _missing_route(exc: OrbitError) -> bool:
    """``True`` for the 404 a server that predates the batched calls answers (no such route)."""
    return isinstance(exc, NotFoundError) and exc.code in ("not_found", "http_404")


def _copy_error(exc: BaseException, first: bool) -> BaseException:
    """The error for one of the reports of a failed batch (each thread raises its own copy)."""
    if first or not isinstance(exc, OrbitError):
        return exc
    return copy.copy(exc)


def _complete_item(attempt: AttemptLease, result: JsonValue) -> CompleteItem:
    """Raises :class:`OrbitUsageError` for a result that is not JSON (nothing is sent)."""
    fields = {"attempt_id": attempt.id, "lease_token": attempt.lease_token, "result": result}
    return _model(CompleteItem, fields, "complete request")


def _fail_item(attempt: AttemptLease, error: AttemptError) -> FailItem:
    return FailItem(attempt_id=attempt.id, lease_token=attempt.lease_token, error=error)


def _start_item(attempt: AttemptLease) -> StartItem:
    return StartItem(attempt_id=attempt.id, lease_token=attempt.lease_token)


def _heartbeat_item(attempt: AttemptLease) -> HeartbeatItem:
    return HeartbeatItem(attempt_id=attempt.id, lease_token=attempt.lease_token)


def _chunks(items: Sequence[_T]) -> list[Sequence[_T]]:
    return [items[i : i + MAX_ATTEMPT_BATCH_ITEMS] for i in range(0, len(items), MAX_ATTEMPT_BATCH_ITEMS)]


# ------------------------------------------------------------------------------------- threads


class _Batcher(Generic[_Item]):
    """Coalesces one kind of report, made by many threads, into batched calls.

    The first thread to report while no batch is forming leads it: it waits up to ``linger``
    seconds (less once ``enough()`` reports wait), takes every waiting report and sends them;
    the others wait for their own result. No thread of its own, so nothing to stop.
    """

    def __init__(
        self,
        send: Callable[[Sequence[_Item]], list[AttemptItemResult]],
        *,
        linger: float,
        enough: Callable[[], int],
    ) -> None:
        self._send = send
        self._linger = linger
        self._enough = enough
        self._cond = threading.Condition()
        self._pending: list[tuple[_Item, Future[AttemptItemResult]]] = []
        self._leading = False
        self.supported = True

    def submit(self, item: _Item) -> AttemptItemResult:
        """Send ``item`` in the next batch; its result (raise the batch request's error)."""
        future: Future[AttemptItemResult] = Future()
        with self._cond:
            self._pending.append((item, future))
            lead = not self._leading
            self._leading = True
            if not lead and len(self._pending) >= self._enough():
                self._cond.notify_all()
        if lead:
            self._lead()
        return future.result()

    def _lead(self) -> None:
        deadline = time.monotonic() + self._linger
        with self._cond:
            while len(self._pending) < self._enough():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._pending = self._pending, []
            self._leading = False
        for chunk in _chunks(batch):
            try:
                results = self._send([item for item, _ in chunk])
            except OrbitError as exc:
                error: BaseException = exc
                if _missing_route(exc):
                    self.supported = False
                    error = _Unsupported()
                    logger.info("the server has no batched attempt calls (404); reporting with single calls")
                for n, (_, future) in enumerate(chunk):
                    future.set_exception(_copy_error(error, n == 0))
                continue
            except BaseException as exc:  # never leave a waiting thread hanging
                for _, future in chunk:
                    future.set_exception(exc)
                raise
            for (_, future), result in zip(chunk, results, strict=True):
                future.set_result(result)


class Reports:
    """The attempt reports of a :class:`~orbit_client.Worker` (thread-safe).

    Args:
        linger: seconds a report may wait for others to share its batched call; ``None``
            sends every report as its own single call.
        in_flight: how many tasks the worker has in flight (no more reports can be waiting).
        starting: how many leased tasks have not had their start answered yet (no more starts
            can be waiting); ``None`` means ``in_flight``.
    """

    def __init__(
        self,
        client: OrbitClient,
        namespace: str,
        *,
        linger: float | None,
        in_flight: Callable[[], int],
        starting: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._batching = linger is not None
        linger = linger or 0.0
        enough = lambda: max(1, in_flight())  # noqa: E731
        # Tasks still reporting their outcome send no start: the start batch goes as soon as every
        # leased task has asked, instead of lingering for reports of another kind.
        starts_enough = enough if starting is None else (lambda: max(1, starting()))
        self._starts = _Batcher[StartItem](
            lambda items: client.start_attempts(namespace, items), linger=linger, enough=starts_enough
        )
        self._completes = _Batcher[CompleteItem](
            lambda items: client.complete_attempts(namespace, items), linger=linger, enough=enough
        )
        self._fails = _Batcher[FailItem](
            lambda items: client.fail_attempts(namespace, items), linger=linger, enough=enough
        )
        self._beats_supported = True

    def _submit(
        self, batcher: _Batcher[_Item], item: _Item, single: Callable[[], AttemptState]
    ) -> AttemptState:
        if self._batching and batcher.supported:
            try:
                return batcher.submit(item).raise_for_status()
            except _Unsupported:
                pass  # the server has no batched calls: send it on its own
        return single()

    def start(self, attempt: AttemptLease) -> AttemptState:
        """Confirm the start; raises what :meth:`OrbitClient.start_attempt` raises."""
        return self._submit(
            self._starts,
            _start_item(attempt),
            lambda: self._client.start_attempt(self._ns, attempt.id, attempt.lease_token),
        )

    def complete(self, attempt: AttemptLease, result: JsonValue) -> AttemptState:
        """Report success; raises what :meth:`OrbitClient.complete_attempt` raises."""
        if _tracing.AVAILABLE and (span := _tracing.report_span("complete", attempt)) is not None:
            with _tracing.use_span(span):
                return self._complete(attempt, result)
        return self._complete(attempt, result)

    def _complete(self, attempt: AttemptLease, result: JsonValue) -> AttemptState:
        return self._submit(
            self._completes,
            _complete_item(attempt, result),
            lambda: self._client.complete_attempt(self._ns, attempt.id, attempt.lease_token, result),
        )

    def fail(self, attempt: AttemptLease, error: AttemptError) -> AttemptState:
        """Report failure; raises what :meth:`OrbitClient.fail_attempt` raises."""
        if _tracing.AVAILABLE and (span := _tracing.report_span("fail", attempt)) is not None:
            with _tracing.use_span(span):
                return self._fail(attempt, error)
        return self._fail(attempt, error)

    def _fail(self, attempt: AttemptLease, error: AttemptError) -> AttemptState:
        return self._submit(
            self._fails,
            _fail_item(attempt, error),
            lambda: self._client.fail_attempt(self._ns, attempt.id, attempt.lease_token, error),
        )

    def heartbeats(self, attempts: Sequence[AttemptLease]) -> list[AttemptState | OrbitError]:
        """Renew each lease; per attempt its state or the error its single heartbeat would raise."""
        if self._batching and self._beats_supported:
            out: list[AttemptState | OrbitError] = []
            try:
                for chunk in _chunks(attempts):
                    results = self._client.heartbeats(self._ns, [_heartbeat_item(a) for a in chunk])
                    out += [_outcome(result) for result in results]
                return out
            except OrbitError as exc:
                if not _missing_route(exc):
                    return out + [exc] * (len(attempts) - len(out))
                self._beats_supported = False
                logger.info("the server has no batched heartbeat call; renewing with single calls")
        return [_single(partial(self._client.heartbeat, self._ns, a.id, a.lease_token)) for a in attempts]


def _outcome(result: AttemptItemResult) -> AttemptState | OrbitError:
    try:
        return result.raise_for_status()
    except OrbitError as exc:
        return exc


def _single(call: Callable[[], AttemptState]) -> AttemptState | OrbitError:
    try:
        return call()
    except OrbitError as exc:
        return exc


# ------------------------------------------------------------------------------------- asyncio


class _AsyncBatcher(Generic[_Item]):
    """The asyncio twin of :class:`_Batcher`: a flush task of its own sends each batch."""

    def __init__(
        self,
        send: Callable[[Sequence[_Item]], Awaitable[list[AttemptItemResult]]],
        *,
        linger: float,
        enough: Callable[[], int],
    ) -> None:
        self._send = send
        self._linger = linger
        self._enough = enough
        self._pending: list[tuple[_Item, asyncio.Future[AttemptItemResult]]] = []
        self._full: asyncio.Event | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self.supported = True

    async def submit(self, item: _Item) -> AttemptItemResult:
        future: asyncio.Future[AttemptItemResult] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._full is None:
            self._full = asyncio.Event()
            flush = asyncio.create_task(self._flush(self._full), name="orbit-report-flush")
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)
        if len(self._pending) >= self._enough():
            self._full.set()
        return await future

    async def _flush(self, full: asyncio.Event) -> None:
        if not full.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(full.wait(), self._linger)
        batch, self._pending, self._full = self._pending, [], None
        for chunk in _chunks(batch):
            try:
                results = await self._send([item for item, _ in chunk])
            except OrbitError as exc:
                error: BaseException = exc
                if _missing_route(exc):
                    self.supported = False
                    error = _Unsupported()
                    logger.info("the server has no batched attempt calls (404); reporting with single calls")
                for n, (_, future) in enumerate(chunk):
                    if not future.done():
                        future.set_exception(_copy_error(error, n == 0))
                continue
            except BaseException as exc:  # e.g. cancelled at shutdown: never leave a report hanging
                for _, future in chunk:
                    if future.done():
                        continue
                    if isinstance(exc, Exception):
                        future.set_exception(exc)
                    else:
                        future.cancel()
                raise
            for (_, future), result in zip(chunk, results, strict=True):
                if not future.done():
                    future.set_result(result)


class AsyncReports:
    """The attempt reports of an :class:`~orbit_client.AsyncWorker` (one event loop); as :class:`Reports`."""

    def __init__(
        self,
        client: AsyncOrbitClient,
        namespace: str,
        *,
        linger: float | None,
        in_flight: Callable[[], int],
        starting: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._batching = linger is not None
        linger = linger or 0.0
        enough = lambda: max(1, in_flight())  # noqa: E731
        # Tasks still reporting their outcome send no start: the start batch goes as soon as every
        # leased task has asked, instead of lingering for reports of another kind.
        starts_enough = enough if starting is None else (lambda: max(1, starting()))
        self._starts = _AsyncBatcher[StartItem](
            lambda items: client.start_attempts(namespace, items), linger=linger, enough=starts_enough
        )
        self._completes = _AsyncBatcher[CompleteItem](
            lambda items: client.complete_attempts(namespace, items), linger=linger, enough=enough
        )
        self._fails = _AsyncBatcher[FailItem](
            lambda items: client.fail_attempts(namespace, items), linger=linger, enough=enough
        )
        self._beats_supported = True

    async def _submit(
        self, batcher: _AsyncBatcher[_Item], item: _Item, single: Callable[[], Awaitable[AttemptState]]
    ) -> AttemptState:
        if self._batching and batcher.supported:
            try:
                return (await batcher.submit(item)).raise_for_status()
            except _Unsupported:
                pass  # the server has no batched calls: send it on its own
        return await single()

    async def start(self, attempt: AttemptLease) -> AttemptState:
        return await self._submit(
            self._starts,
            _start_item(attempt),
            lambda: self._client.start_attempt(self._ns, attempt.id, attempt.lease_token),
        )

    async def complete(self, attempt: AttemptLease, result: JsonValue) -> AttemptState:
        if _tracing.AVAILABLE and (span := _tracing.report_span("complete", attempt)) is not None:
            with _tracing.use_span(span):
                return await self._complete(attempt, result)
        return await self._complete(attempt, result)

    async def _complete(self, attempt: AttemptLease, result: JsonValue) -> AttemptState:
        return await self._submit(
            self._completes,
            _complete_item(attempt, result),
            lambda: self._client.complete_attempt(self._ns, attempt.id, attempt.lease_token, result),
        )

    async def fail(self, attempt: AttemptLease, error: AttemptError) -> AttemptState:
        if _tracing.AVAILABLE and (span := _tracing.report_span("fail", attempt)) is not None:
            with _tracing.use_span(span):
                return await self._fail(attempt, error)
        return await self._fail(attempt, error)

    async def _fail(self, attempt: AttemptLease, error: AttemptError) -> AttemptState:
        return await self._submit(
            self._fails,
            _fail_item(attempt, error),
            lambda: self._client.fail_attempt(self._ns, attempt.id, attempt.lease_token, error),
        )

    async def heartbeats(self, attempts: Sequence[AttemptLease]) -> list[AttemptState | OrbitError]:
        if self._batching and self._beats_supported:
            out: list[AttemptState | OrbitError] = []
            try:
                for chunk in _chunks(attempts):
                    results = await self._client.heartbeats(self._ns, [_heartbeat_item(a) for a in chunk])
                    out += [_outcome(result) for result in results]
                return out
            except OrbitError as exc:
                if not _missing_route(exc):
                    return out + [exc] * (len(attempts) - len(out))
                self._beats_supported = False
                logger.info("the server has no batched heartbeat call; renewing with single calls")
        out = []
        for attempt in attempts:
            try:
                out.append(await self._client.heartbeat(self._ns, attempt.id, attempt.lease_token))
            except OrbitError as exc:
                out.append(exc)
        return out
