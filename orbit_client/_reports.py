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

A batch is split by encoded size below the server's body limit (``max_body_bytes`` of
``GET /v1/settings``, read once), not only by item count, so that reports each under the limit
never make a batch the server refuses whole; a batch refused whole with ``413`` all the same
(another proxy's limit, an older server) is sent again as single calls, one report each, so one
report too large for any request fails alone.

A ``complete`` or ``fail`` batch may carry the worker's next lease (*report-and-lease*, DESIGN
§4): when the worker hands its reports a :class:`LeaseRider`, the batch asks it, as it leaves,
whether to carry a lease request for the slots its reports free; the server commits the reports
first and grants after, and the grants (or the reason there are none) go back to the rider.

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
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, JsonValue

from orbit_client import _tracing
from orbit_client._attempt_models import (
    MAX_ATTEMPT_BATCH_ITEMS,
    AttemptBatchResponse,
    AttemptError,
    AttemptItemResult,
    AttemptLease,
    AttemptState,
    BatchLease,
    CompleteItem,
    FailItem,
    HeartbeatItem,
    LeaseGrant,
    StartItem,
)
from orbit_client._calls import _validated
from orbit_client._client import AsyncOrbitClient, OrbitClient
from orbit_client._exceptions import NotFoundError, OrbitError, PayloadTooLargeError

__all__ = ["DEFAULT_BODY_LIMIT", "AsyncReports", "LeaseRider", "Reports"]

logger = logging.getLogger("orbit_client.worker")

_Item = TypeVar("_Item", bound=BaseModel)
_T = TypeVar("_T")


#: The server's body limit assumed until ``GET /v1/settings`` says otherwise (its default, 256 KiB).
DEFAULT_BODY_LIMIT = 256 * 1024
#: Bytes of a batch body besides its items (``{"items":[...]}`` and a lease request), kept free.
_BODY_MARGIN = 2048


class _Unsupported(Exception):
    """The server has no batched calls: send this report on its own."""


class _TooLarge(Exception):
    """The batch was refused whole with 413: send this report on its own."""


class LeaseRider(Protocol):
    """How a worker lets its ``complete``/``fail`` batches carry its next lease (report-and-lease)."""

    def ask(self, reports: int) -> BatchLease | None:
        """Called as a batch of ``reports`` leaves: the lease request it carries, or ``None``."""

    def got(self, ask: BatchLease, sent_at: float, grants: list[LeaseGrant] | None, error: object) -> None:
        """The answer to ``ask`` (sent at ``sent_at``, ``time.monotonic()``): its grants, or
        ``None`` and why (a :class:`Problem` of the lease part, or the request's exception)."""

    def timed(self, seconds: float) -> None:
        """A ``complete``/``fail`` batch (carrying a lease or not) was answered after ``seconds``."""


def _missing_route(exc: OrbitError) -> bool:
    """``True`` for the 404 a server that predates the batched calls answers (no such route)."""
    return isinstance(exc, NotFoundError) and exc.code in ("not_found", "http_404")


def _copy_error(exc: BaseException, first: bool) -> BaseException:
    """The error for one of the reports of a failed batch (each thread raises its own copy)."""
    if first or not isinstance(exc, OrbitError):
        return exc
    return copy.copy(exc)


def _complete_item(attempt: AttemptLease, result: JsonValue, task_id: str | None = None) -> CompleteItem:
    """Raises :class:`OrbitUsageError` for a result that is not JSON (nothing is sent)."""
    # Validated once: the item holds its own copy of ``result`` (JsonValue copies containers) in JSON
    # types (a str or int subclass becomes str or int), as a model -> JSON -> model round trip would.
    return _validated(CompleteItem, "complete request", attempt_id=attempt.id, lease_token=attempt.lease_token,
                      result=result, task_id=task_id)  # fmt: skip


def _fail_item(attempt: AttemptLease, error: AttemptError) -> FailItem:
    return FailItem(attempt_id=attempt.id, lease_token=attempt.lease_token, error=error)


def _start_item(attempt: AttemptLease, task_id: str | None = None) -> StartItem:
    return StartItem(attempt_id=attempt.id, lease_token=attempt.lease_token, task_id=task_id)


def _heartbeat_item(attempt: AttemptLease) -> HeartbeatItem:
    return HeartbeatItem(attempt_id=attempt.id, lease_token=attempt.lease_token)


def _chunks(items: Sequence[_T]) -> list[Sequence[_T]]:
    return [items[i : i + MAX_ATTEMPT_BATCH_ITEMS] for i in range(0, len(items), MAX_ATTEMPT_BATCH_ITEMS)]


def _sized_chunks(batch: Sequence[tuple[_Item, _T]], limit: int) -> list[Sequence[tuple[_Item, _T]]]:
    """``batch`` in request-sized pieces: at most :data:`MAX_ATTEMPT_BATCH_ITEMS` items and, in
    encoded JSON, at most ``limit`` bytes less :data:`_BODY_MARGIN` (a single item over it goes
    alone: the server then refuses it alone)."""
    room = max(1, limit - _BODY_MARGIN)
    out: list[Sequence[tuple[_Item, _T]]] = []
    chunk: list[tuple[_Item, _T]] = []
    used = 0
    for entry in batch:
        size = len(entry[0].__pydantic_serializer__.to_json(entry[0])) + 1
        if chunk and (used + size > room or len(chunk) >= MAX_ATTEMPT_BATCH_ITEMS):
            out.append(chunk)
            chunk, used = [], 0
        chunk.append(entry)
        used += size
    if chunk:
        out.append(chunk)
    return out


def _refused_whole(exc: OrbitError) -> bool:
    return isinstance(exc, PayloadTooLargeError)


# ------------------------------------------------------------------------------------- threads


class _Batcher(Generic[_Item]):
    """Coalesces one kind of report, made by many threads, into batched calls.

    The first thread to report while no batch is forming leads it: it waits up to ``linger``
    seconds (less once ``enough()`` reports wait), takes every waiting report and sends them,
    split by :func:`_sized_chunks` below ``limit()`` bytes; the others wait for their own result.
    No thread of its own, so nothing to stop. With a ``rider``, each request asks it for a lease
    to carry (``send_riding``).
    """

    def __init__(
        self,
        send: Callable[[Sequence[_Item]], list[AttemptItemResult]],
        *,
        linger: float,
        enough: Callable[[], int],
        limit: Callable[[], int] = lambda: DEFAULT_BODY_LIMIT,
        send_riding: Callable[[Sequence[_Item], BatchLease], AttemptBatchResponse] | None = None,
        rider: LeaseRider | None = None,
        busy: Callable[[], int] | None = None,
    ) -> None:
        self._send = send
        self._send_riding = send_riding
        self.rider = rider
        self._linger = linger
        self._enough = enough
        self._busy = busy
        self._limit = limit
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
            if not lead and self._full():
                self._cond.notify_all()
        if lead:
            self._lead()
        return future.result()

    def forming(self) -> bool:
        """Whether reports are waiting for (or leading) a batch that has not left yet."""
        with self._cond:
            return bool(self._pending)

    def wake(self) -> None:
        """Look again whether a forming batch may leave (what ``busy`` counts has changed)."""
        with self._cond:
            self._cond.notify_all()

    def _full(self) -> bool:
        """Whether no more reports can join: ``enough()`` wait, or (with ``busy``) nothing is busy."""
        if self._busy is not None:
            return self._busy() <= 0
        return len(self._pending) >= self._enough()

    def _lead(self) -> None:
        deadline = time.monotonic() + self._linger
        with self._cond:
            while not self._full():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, self._pending = self._pending, []
            self._leading = False
        try:
            self._send_chunks(batch)
        except BaseException as exc:  # every report of the batch is answered, on every path
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            raise

    def _send_chunks(self, batch: list[tuple[_Item, Future[AttemptItemResult]]]) -> None:
        for chunk in _sized_chunks(batch, self._limit()):
            items = [item for item, _ in chunk]
            rider, ask = self.rider, None
            if rider is not None and self._send_riding is not None:
                ask = rider.ask(len(items))
            sent_at = time.monotonic()
            try:
                if ask is not None:
                    assert self._send_riding is not None and rider is not None
                    answer = self._send_riding(items, ask)
                    results = answer.items
                    rider.got(ask, sent_at, answer.grants if answer.lease_error is None else None,
                              answer.lease_error)  # fmt: skip
                else:
                    results = self._send(items)
                if rider is not None:
                    rider.timed(time.monotonic() - sent_at)
            except OrbitError as exc:
                if ask is not None and rider is not None:
                    rider.got(ask, sent_at, None, exc)
                error: BaseException = exc
                if _missing_route(exc):
                    self.supported = False
                    error = _Unsupported()
                    logger.info("the server has no batched attempt calls (404); reporting with single calls")
                elif _refused_whole(exc):
                    error = _TooLarge()
                    logger.warning(
                        "a batch of %d reports was refused whole as too large (413); sending each alone",
                        len(chunk),
                    )
                for n, (_, future) in enumerate(chunk):
                    future.set_exception(_copy_error(error, n == 0))
                continue
            except BaseException as exc:  # never leave a waiting thread hanging
                if ask is not None and rider is not None:
                    rider.got(ask, sent_at, None, exc)
                for _, future in chunk:
                    future.set_exception(exc)
                raise
            for (_, future), result in zip(chunk, results, strict=True):
                future.set_result(result)


class _BodyLimit:
    """The server's body limit (``GET /v1/settings``), read once, the first time a batch leaves;
    :data:`DEFAULT_BODY_LIMIT` when it cannot be read (an older server, an outage: a 413 still
    falls back to single calls)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._value: int | None = None

    def __call__(self) -> int:
        if self._value is None:
            try:
                self._value = int(self._read())
            except OrbitError as exc:
                logger.info(
                    "could not read the server's body limit (%s); assuming %d bytes", exc, DEFAULT_BODY_LIMIT
                )
                self._value = DEFAULT_BODY_LIMIT
        return self._value


class Reports:
    """The attempt reports of a :class:`~orbit_client.Worker` (thread-safe).

    Args:
        linger: seconds a report may wait for others to share its batched call; ``None``
            sends every report as its own single call.
        in_flight: how many reports can still come (no more can be waiting).
        starting: how many leased tasks have not had their start answered yet (no more starts
            can be waiting); ``None`` means ``in_flight``.
        rider: lets ``complete``/``fail`` batches carry the worker's next lease; ``None``: never.
        body_limit: the server's body limit in bytes, when the caller read it already; ``None``:
            read it from ``GET /v1/settings`` when the first batch leaves.
        busy: how many handlers are running (each may still report); when given, a ``complete`` or
            ``fail`` batch leaves as soon as none is (or at ``linger``), instead of counting ``in_flight``.
    """

    def __init__(
        self,
        client: OrbitClient,
        namespace: str,
        *,
        linger: float | None,
        in_flight: Callable[[], int],
        starting: Callable[[], int] | None = None,
        rider: LeaseRider | None = None,
        body_limit: int | None = None,
        busy: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._batching = linger is not None
        linger = linger or 0.0
        enough = lambda: max(1, in_flight())  # noqa: E731
        limit = _BodyLimit(lambda: client.get_settings().max_body_bytes if body_limit is None else body_limit)
        # Tasks still reporting their outcome send no start: the start batch goes as soon as every
        # leased task has asked, instead of lingering for reports of another kind.
        starts_enough = enough if starting is None else (lambda: max(1, starting()))
        self._starts = _Batcher[StartItem](
            lambda items: client.start_attempts(namespace, items), linger=linger, enough=starts_enough,
            limit=limit,
        )  # fmt: skip
        self._completes = _Batcher[CompleteItem](
            lambda items: client.complete_attempts(namespace, items), linger=linger, enough=enough, limit=limit,
            send_riding=lambda items, lease: client.complete_attempts_and_lease(namespace, items, lease=lease),
            rider=rider, busy=busy,
        )  # fmt: skip
        self._fails = _Batcher[FailItem](
            lambda items: client.fail_attempts(namespace, items), linger=linger, enough=enough, limit=limit,
            send_riding=lambda items, lease: client.fail_attempts_and_lease(namespace, items, lease=lease),
            rider=rider, busy=busy,
        )  # fmt: skip
        self._beats_supported = True

    def forming(self) -> bool:
        """Whether a ``complete`` or ``fail`` batch is forming (it may carry the next lease)."""
        return self._completes.forming() or self._fails.forming()

    def wake(self) -> None:
        """What ``busy`` counts has changed (a start was answered): a forming ``complete`` or ``fail``
        batch looks again whether it may leave."""
        self._completes.wake()
        self._fails.wake()

    def _submit(
        self, batcher: _Batcher[_Item], item: _Item, single: Callable[[], AttemptState]
    ) -> AttemptState:
        if self._batching and batcher.supported:
            try:
                return batcher.submit(item).raise_for_status()
            except (_Unsupported, _TooLarge):
                pass  # no batched calls, or the batch was too large as a whole: send it on its own
        return single()

    def start(self, attempt: AttemptLease, task_id: str | None = None) -> AttemptState:
        """Confirm the start; raises what :meth:`OrbitClient.start_attempt` raises. ``task_id``: the attempt's
        task, named in a batched report (``StartItem.task_id``; only to a server whose settings offer it)."""
        return self._submit(
            self._starts,
            _start_item(attempt, task_id),
            lambda: self._client.start_attempt(self._ns, attempt.id, attempt.lease_token),
        )

    def complete(self, attempt: AttemptLease, result: JsonValue, task_id: str | None = None) -> AttemptState:
        """Report success; raises what :meth:`OrbitClient.complete_attempt` raises. ``task_id``: as for
        :meth:`start`."""
        if _tracing.AVAILABLE and (span := _tracing.report_span("complete", attempt)) is not None:
            with _tracing.use_span(span):
                return self._complete(attempt, result, task_id)
        return self._complete(attempt, result, task_id)

    def _complete(self, attempt: AttemptLease, result: JsonValue, task_id: str | None) -> AttemptState:
        return self._submit(
            self._completes,
            _complete_item(attempt, result, task_id),
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
        limit: Callable[[], Awaitable[int]] | None = None,
        send_riding: Callable[[Sequence[_Item], BatchLease], Awaitable[AttemptBatchResponse]] | None = None,
        rider: LeaseRider | None = None,
        busy: Callable[[], int] | None = None,
    ) -> None:
        self._send = send
        self._send_riding = send_riding
        self.rider = rider
        self._linger = linger
        self._enough = enough
        self._busy = busy
        self._limit = limit
        self._pending: list[tuple[_Item, asyncio.Future[AttemptItemResult]]] = []
        self._full: asyncio.Event | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self.supported = True

    def forming(self) -> bool:
        return bool(self._pending)

    def wake(self) -> None:
        """Let a forming batch leave now if ``busy`` says no more reports can join."""
        if self._full is not None and self._full_now():
            self._full.set()

    def _full_now(self) -> bool:
        if self._busy is not None:
            return self._busy() <= 0
        return len(self._pending) >= self._enough()

    async def submit(self, item: _Item) -> AttemptItemResult:
        future: asyncio.Future[AttemptItemResult] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._full is None:
            self._full = asyncio.Event()
            flush = asyncio.create_task(self._flush(self._full), name="orbit-report-flush")
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)
        if self._full_now():
            self._full.set()
        return await future

    async def _flush(self, full: asyncio.Event) -> None:
        if not full.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(full.wait(), self._linger)
        batch, self._pending, self._full = self._pending, [], None
        try:
            await self._send_chunks(batch)
        except BaseException as exc:  # every report of the batch is answered, on every path
            for _, future in batch:
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            raise

    async def _send_chunks(self, batch: list[tuple[_Item, asyncio.Future[AttemptItemResult]]]) -> None:
        limit = await self._limit() if self._limit is not None else DEFAULT_BODY_LIMIT
        for chunk in _sized_chunks(batch, limit):
            items = [item for item, _ in chunk]
            rider, ask = self.rider, None
            if rider is not None and self._send_riding is not None:
                ask = rider.ask(len(items))
            sent_at = time.monotonic()
            try:
                if ask is not None:
                    assert self._send_riding is not None and rider is not None
                    answer = await self._send_riding(items, ask)
                    results = answer.items
                    rider.got(ask, sent_at, answer.grants if answer.lease_error is None else None,
                              answer.lease_error)  # fmt: skip
                else:
                    results = await self._send(items)
                if rider is not None:
                    rider.timed(time.monotonic() - sent_at)
            except OrbitError as exc:
                if ask is not None and rider is not None:
                    rider.got(ask, sent_at, None, exc)
                error: BaseException = exc
                if _missing_route(exc):
                    self.supported = False
                    error = _Unsupported()
                    logger.info("the server has no batched attempt calls (404); reporting with single calls")
                elif _refused_whole(exc):
                    error = _TooLarge()
                    logger.warning(
                        "a batch of %d reports was refused whole as too large (413); sending each alone",
                        len(chunk),
                    )
                for n, (_, future) in enumerate(chunk):
                    if not future.done():
                        future.set_exception(_copy_error(error, n == 0))
                continue
            except BaseException as exc:  # e.g. cancelled at shutdown: never leave a report hanging
                if ask is not None and rider is not None:
                    rider.got(ask, sent_at, None, exc)
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


class _AsyncBodyLimit:
    """The asyncio twin of :class:`_BodyLimit`."""

    def __init__(self, read: Callable[[], Awaitable[int]]) -> None:
        self._read = read
        self._value: int | None = None

    async def __call__(self) -> int:
        if self._value is None:
            try:
                self._value = int(await self._read())
            except OrbitError as exc:
                logger.info(
                    "could not read the server's body limit (%s); assuming %d bytes", exc, DEFAULT_BODY_LIMIT
                )
                self._value = DEFAULT_BODY_LIMIT
        return self._value


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
        rider: LeaseRider | None = None,
        body_limit: int | None = None,
        busy: Callable[[], int] | None = None,
    ) -> None:
        self._client = client
        self._ns = namespace
        self._batching = linger is not None
        linger = linger or 0.0
        enough = lambda: max(1, in_flight())  # noqa: E731

        async def read_limit() -> int:
            if body_limit is not None:
                return body_limit
            return (await client.get_settings()).max_body_bytes

        limit = _AsyncBodyLimit(read_limit)
        # Tasks still reporting their outcome send no start: the start batch goes as soon as every
        # leased task has asked, instead of lingering for reports of another kind.
        starts_enough = enough if starting is None else (lambda: max(1, starting()))
        self._starts = _AsyncBatcher[StartItem](
            lambda items: client.start_attempts(namespace, items), linger=linger, enough=starts_enough,
            limit=limit,
        )  # fmt: skip
        self._completes = _AsyncBatcher[CompleteItem](
            lambda items: client.complete_attempts(namespace, items), linger=linger, enough=enough, limit=limit,
            send_riding=lambda items, lease: client.complete_attempts_and_lease(namespace, items, lease=lease),
            rider=rider, busy=busy,
        )  # fmt: skip
        self._fails = _AsyncBatcher[FailItem](
            lambda items: client.fail_attempts(namespace, items), linger=linger, enough=enough, limit=limit,
            send_riding=lambda items, lease: client.fail_attempts_and_lease(namespace, items, lease=lease),
            rider=rider, busy=busy,
        )  # fmt: skip
        self._beats_supported = True

    def forming(self) -> bool:
        """Whether a ``complete`` or ``fail`` batch is forming (it may carry the next lease)."""
        return self._completes.forming() or self._fails.forming()

    def wake(self) -> None:
        """What ``busy`` counts has changed (a start was answered): a forming ``complete`` or ``fail``
        batch looks again whether it may leave."""
        self._completes.wake()
        self._fails.wake()

    async def _submit(
        self, batcher: _AsyncBatcher[_Item], item: _Item, single: Callable[[], Awaitable[AttemptState]]
    ) -> AttemptState:
        if self._batching and batcher.supported:
            try:
                return (await batcher.submit(item)).raise_for_status()
            except (_Unsupported, _TooLarge):
                pass  # no batched calls, or the batch was too large as a whole: send it on its own
        return await single()

    async def start(self, attempt: AttemptLease, task_id: str | None = None) -> AttemptState:
        return await self._submit(
            self._starts,
            _start_item(attempt, task_id),
            lambda: self._client.start_attempt(self._ns, attempt.id, attempt.lease_token),
        )

    async def complete(
        self, attempt: AttemptLease, result: JsonValue, task_id: str | None = None
    ) -> AttemptState:
        if _tracing.AVAILABLE and (span := _tracing.report_span("complete", attempt)) is not None:
            with _tracing.use_span(span):
                return await self._complete(attempt, result, task_id)
        return await self._complete(attempt, result, task_id)

    async def _complete(self, attempt: AttemptLease, result: JsonValue, task_id: str | None) -> AttemptState:
        return await self._submit(
            self._completes,
            _complete_item(attempt, result, task_id),
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
