"""Task calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`: submit
(one or a batch), look up, list, cancel, review and retry tasks; the server's settings and a queue's
counts. README "Using the client", "Batch acceptance".

Each call is one function that builds its :class:`~orbit_client._calls._Call` (no I/O); the two
mixins send it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx
from pydantic import JsonValue, ValidationError

from orbit_client import _tracing
from orbit_client._attempt_models import Attempt
from orbit_client._calls import (
    _body,
    _Call,
    _check_key,
    _invalid_response,
    _key_headers,
    _many,
    _one,
    _parse_model,
    _path,
    _Sends,
    _SendsAsync,
)
from orbit_client._exceptions import OrbitUsageError
from orbit_client._queue_models import Queue
from orbit_client._settings_models import ServerInfo
from orbit_client._task_models import (
    BatchItem,
    BatchItemResult,
    BatchSubmitResponse,
    CancelRequest,
    RetryRequest,
    ReviewRequest,
    SubmitOptions,
    SubmitResult,
    Task,
    TaskEvent,
    TaskPage,
    TaskStatus,
    TaskSubmission,
)

__all__: list[str] = []


def _submit_task(
    namespace: str,
    queue: str,
    handler: str,
    params: Any,
    idempotency_key: str,
    options: SubmitOptions | Mapping[str, Any] | None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> _Call[SubmitResult]:
    """Validate a submission: ``POST /v1/namespaces/{ns}/tasks`` with its ``Idempotency-Key``."""
    headers = _key_headers(idempotency_key, traceparent, tracestate, trace=True)
    path = _path("/v1/namespaces/{}/tasks", namespace)
    try:
        if options is not None and not isinstance(options, SubmitOptions):
            options = SubmitOptions.model_validate(dict(options))
        submission = TaskSubmission(queue=queue, handler=handler, params=params, options=options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        # ``from None``: pydantic's own message repeats the input, and params must never be logged.
        raise OrbitUsageError(f"invalid submission, nothing was sent: {problems}") from None
    body = submission.model_dump(mode="json", exclude_none=True)
    return _Call("POST", path, _parse_submit, json=body, headers=headers)


def _parse_submit(response: httpx.Response) -> SubmitResult:
    """201 → a new task; 200 → replayed when ``Idempotent-Replayed: true`` (DESIGN §3)."""
    task = _parse_model(Task, response)
    replayed = response.status_code == 200 and (
        response.headers.get("Idempotent-Replayed", "").strip().lower() == "true"
    )
    return SubmitResult(task=task, replayed=replayed)


def _submit_tasks(
    namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
) -> _Call[list[BatchItemResult]]:
    """Validate a batch submission: ``POST /v1/namespaces/{ns}/tasks/batch``.

    Raises :class:`OrbitUsageError` for an empty batch or a malformed item, naming the
    item's index and the bad fields (never their values: params may be secret).
    """
    path = _path("/v1/namespaces/{}/tasks/batch", namespace)
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
        raise OrbitUsageError(
            "items is a list of BatchItem or mappings (one per submission); nothing was sent"
        )
    if not items:
        raise OrbitUsageError("items is empty: a batch needs at least one item; nothing was sent")
    bodies: list[dict[str, Any]] = []
    # Items without a trace context of their own continue the caller's active span, if any.
    traceparent, tracestate = _tracing.current() if _tracing.AVAILABLE else (None, None)
    for index, item in enumerate(items):
        if not isinstance(item, BatchItem):
            if not isinstance(item, Mapping):
                raise OrbitUsageError(
                    f"items[{index}] is a {type(item).__name__}, not a BatchItem or a mapping; nothing was sent"
                )
            try:
                item = BatchItem.model_validate(dict(item))
            except ValidationError as exc:
                problems = "; ".join(
                    f"items[{index}].{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                    for e in exc.errors(include_url=False, include_input=False)
                )
                # ``from None``: pydantic's own message repeats the input (params may be secret).
                raise OrbitUsageError(f"invalid batch item, nothing was sent: {problems}") from None
        body = item.model_dump(mode="json", exclude_none=True, exclude_unset=True)
        if traceparent is not None and "traceparent" not in body:
            body["traceparent"] = traceparent
            if tracestate:
                body["tracestate"] = tracestate
        bodies.append(body)
    count = len(bodies)

    def parse(response: httpx.Response) -> list[BatchItemResult]:
        results = _parse_model(BatchSubmitResponse, response).items
        if len(results) != count:
            raise _invalid_response(
                response,
                f"the server answered {len(results)} results for {count} items; the items may have been "
                "accepted: send the same batch again (every item keeps its idempotency key) or look the "
                "keys up with find_submission()",
            )
        return results

    return _Call("POST", path, parse, json={"items": bodies})


def _get_task(namespace: str, task_id: str) -> _Call[Task]:
    return _Call("GET", _path("/v1/namespaces/{}/tasks/{}", namespace, task_id), _one(Task))


def _find_submission(namespace: str, idempotency_key: str) -> _Call[Task | None]:
    """``GET submissions/{key}``: ``None`` on 404 ``submission_not_found``; a malformed key raises."""
    _check_key(idempotency_key)
    path = _path("/v1/namespaces/{}/submissions/{}", namespace, idempotency_key)
    return _Call("GET", path, _one(Task), absent_code="submission_not_found")


def _get_settings() -> _Call[ServerInfo]:
    return _Call("GET", "/v1/settings", _one(ServerInfo))


def _get_queue(namespace: str, queue: str) -> _Call[Queue]:
    return _Call("GET", _path("/v1/namespaces/{}/queues/{}", namespace, queue), _one(Queue))


def _cancel_task(namespace: str, task_id: str, reason: str) -> _Call[Task]:
    path = _path("/v1/namespaces/{}/tasks/{}/cancel", namespace, task_id)
    return _Call("POST", path, _one(Task), json=_body(CancelRequest, "cancel request", reason=reason))


def _review_task(
    namespace: str,
    task_id: str,
    outcome: str,
    reason: str,
    evidence_ref: str,
    result: JsonValue,
    actor: str | None,
) -> _Call[Task]:
    path = _path("/v1/namespaces/{}/tasks/{}/review", namespace, task_id)
    fields: dict[str, Any] = {"outcome": outcome, "reason": reason, "evidence_ref": evidence_ref}
    if result is not None:
        fields["result"] = result
    if actor is not None:
        fields["actor"] = actor
    body = _body(ReviewRequest, "review request", **fields)
    return _Call("POST", path, _one(Task), json=body, retry=False)


def _retry_task(namespace: str, task_id: str, reason: str, deadline: datetime | None) -> _Call[Task]:
    path = _path("/v1/namespaces/{}/tasks/{}/retry", namespace, task_id)
    fields: dict[str, Any] = {"reason": reason}
    if deadline is not None:
        fields["deadline"] = deadline
    body = _body(RetryRequest, "retry request", **fields)
    return _Call("POST", path, _one(Task), json=body, retry=False)


def _list_attempts(namespace: str, task_id: str) -> _Call[list[Attempt]]:
    return _Call("GET", _path("/v1/namespaces/{}/tasks/{}/attempts", namespace, task_id), _many(Attempt))


def _list_task_events(namespace: str, task_id: str) -> _Call[list[TaskEvent]]:
    return _Call("GET", _path("/v1/namespaces/{}/tasks/{}/events", namespace, task_id), _many(TaskEvent))


def _list_tasks(
    namespace: str, status: TaskStatus | str | None, queue: str | None, limit: int, cursor: str | None
) -> _Call[TaskPage]:
    path = _path("/v1/namespaces/{}/tasks", namespace)
    if not 1 <= limit <= 1000:
        raise OrbitUsageError(f"limit must be between 1 and 1000, not {limit!r}")
    params = {"limit": str(limit)}
    if status is not None:
        params["status"] = TaskStatus(status).value
    if queue is not None:
        params["queue"] = queue
    if cursor is not None:
        params["cursor"] = cursor
    return _Call("GET", path, _one(TaskPage), params=params)


class TaskCallsMixin(_Sends):
    """The task calls of :class:`~orbit_client.OrbitClient`."""

    def submit_task(
        self,
        namespace: str,
        queue: str,
        handler: str,
        params: Any,
        *,
        idempotency_key: str,
        options: SubmitOptions | Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> SubmitResult:
        """Submit a task, at most once per idempotency key (``POST /v1/namespaces/{ns}/tasks``).

        Retried on retryable errors: safe, because every attempt carries the same
        ``Idempotency-Key`` (IETF Idempotency-Key draft; README "Using the client").

        Args:
            namespace: the namespace the API key belongs to.
            queue: the queue's name.
            handler: the handler name workers dispatch on, e.g. ``"orders.fulfil"``.
            params: any JSON value, stored and returned unchanged (no NaN or infinities).
            idempotency_key: 1-255 printable ASCII characters naming this submission; reuse
                it, and only it, when sending the same submission again.
            options: :class:`SubmitOptions` or a mapping of its fields; ``None`` means the
                server's defaults.
            traceparent, tracestate: the task's W3C Trace Context, sent as the ``traceparent``
                and ``tracestate`` headers and stored with the task (README "Tracing");
                ``None`` means the active OpenTelemetry span's, if ``opentelemetry-api`` is
                installed and a span is active, else none.

        Returns:
            The task and whether the answer was a replay of an earlier submission with the
            same key (``200`` + ``Idempotent-Replayed: true``) rather than a new task (``201``).

        Raises:
            OrbitUsageError: malformed key or invalid arguments; nothing was sent.
            IdempotencyKeyReusedError: the key already names a different submission (422).
            OrbitOutcomeUnknownError, ServerError: the task may or may not exist; retry with
                the same key or call :meth:`find_submission`.
            OrbitAPIError: any other error status (see the exception tree).
        """
        return self._send(
            _submit_task(namespace, queue, handler, params, idempotency_key, options, traceparent, tracestate)
        )

    def submit_tasks(
        self, namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
    ) -> list[BatchItemResult]:
        """Submit many tasks in one request (``POST /v1/namespaces/{ns}/tasks/batch``).

        Each item is handled exactly as :meth:`submit_task` would handle it alone (same
        request digest, replay and ``idempotency_key_reused`` rules), all in one server
        transaction; one bad item never fails the others. Two items with the same key are
        handled one after the other (the second replays the first). Retried on retryable
        errors like :meth:`submit_task`: safe, because every item carries its own key.

        Args:
            namespace: the namespace the API key belongs to.
            items: 1 to ``ORBIT_MAX_BATCH_ITEMS`` (server setting, default 500) items, each a
                :class:`BatchItem` or a mapping of its fields: ``{"idempotency_key": str,
                "queue": str, "handler": str, "params": <JSON>, "options": {...},
                "traceparent": str, "tracestate": str}`` (all but the first three optional;
                an item without ``traceparent`` gets the active OpenTelemetry span's, if any:
                README "Tracing"). The whole body must also fit the server's
                ``ORBIT_MAX_BODY_BYTES`` (default 256 KiB).

        Returns:
            One :class:`BatchItemResult` per item, in the order given: ``status`` 201 (a new
            ``task``), 200 (``replayed``: the original ``task``), or an error status with the
            problem body the single endpoint would answer as ``error``: 400
            ``idempotency_key_invalid``, 404 ``queue_not_found``, 409 ``request_in_progress``
            (send that item again with the same key), 422 ``idempotency_key_reused`` or
            ``validation_error``. Per-item errors are results, never raised.

        Raises:
            OrbitUsageError: ``items`` is empty or an item is malformed (bad key, queue name,
                params or options); nothing was sent.
            PayloadTooLargeError: the body exceeds the server's limit (413): split the batch.
            UnprocessableEntityError: ``validation_error`` for the request as a whole, e.g.
                more items than ``ORBIT_MAX_BATCH_ITEMS`` (422).
            OrbitOutcomeUnknownError, ServerError: some or all items may have been accepted;
                send the same batch again (same keys) or call :meth:`find_submission`.
            OrbitAPIError: any other error status (401, 403, ...; see the exception tree).
        """
        return self._send(_submit_tasks(namespace, items))

    def get_task(self, namespace: str, task_id: str) -> Task:
        """Fetch a task (``GET /v1/namespaces/{ns}/tasks/{id}``).

        Raises:
            NotFoundError: no such task in this namespace (also for another namespace's ids).
            OrbitError: as for every call.
        """
        return self._send(_get_task(namespace, task_id))

    def find_submission(self, namespace: str, idempotency_key: str) -> Task | None:
        """Find the task an idempotency key created (``GET /v1/namespaces/{ns}/submissions/{key}``).

        This is how to settle an outcome-unknown submission (README "Using the client").

        Returns:
            The task, or ``None`` when the server answers 404 ``submission_not_found``
            (nothing was accepted under this key, or it expired after its retention window).

        Raises:
            OrbitUsageError: malformed key; nothing was sent.
            NotFoundError: any other 404, e.g. an unknown namespace.
            OrbitAPIError: 410 ``task_purged``: the key is remembered but its finished task was
                purged; ``error.problem.task_id`` names it (README "Retention and the key window").
            OrbitError: as for every call.
        """
        return self._send(_find_submission(namespace, idempotency_key))

    def get_settings(self) -> ServerInfo:
        """The server's published settings, e.g. its key window (``GET /v1/settings``, any valid API key).

        Raises:
            NotFoundError: an older server without the route (it purges no keys: no key window).
            OrbitError: as for every call.
        """
        return self._send(_get_settings())

    def get_queue(self, namespace: str, queue: str) -> Queue:
        """Fetch a queue and its task counts per state (``GET /v1/namespaces/{ns}/queues/{queue}``).

        Raises:
            NotFoundError: no such queue or namespace.
            OrbitError: as for every call.
        """
        return self._send(_get_queue(namespace, queue))

    def cancel_task(self, namespace: str, task_id: str, *, reason: str) -> Task:
        """Cancel a task (``admin`` key): ``WAITING``/``LEASED`` at once, ``RUNNING`` once its worker stops.

        Idempotent, so retried. Returns the task (``cancel_requested`` set).

        Raises:
            InvalidTransitionError: the task is ``SUCCEEDED``, ``FAILED`` or ``NEEDS_REVIEW``.
            OrbitError: as for every call.
        """
        return self._send(_cancel_task(namespace, task_id, reason))

    def review_task(
        self,
        namespace: str,
        task_id: str,
        *,
        outcome: str,
        reason: str,
        evidence_ref: str,
        result: JsonValue = None,
        actor: str | None = None,
    ) -> Task:
        """Settle a ``NEEDS_REVIEW`` task (``admin`` key) as ``"succeeded"`` (with ``result``) or ``"failed"``.

        Audited on the server with the key, ``actor``, ``reason`` and ``evidence_ref``. Not
        retried by the client.

        Raises:
            InvalidTransitionError: the task is not ``NEEDS_REVIEW``.
            OrbitError: as for every call.
        """
        return self._send(_review_task(namespace, task_id, outcome, reason, evidence_ref, result, actor))

    def retry_task(
        self, namespace: str, task_id: str, *, reason: str, deadline: datetime | None = None
    ) -> Task:
        """Create the one successor (``retry_of``) of a ``FAILED`` or ``CANCELLED`` task (``admin`` key).

        Not retried by the client; after an unknown outcome, call again: a
        :class:`SuccessorExistsError` then names the successor (``successor_id``).

        Args:
            deadline: the new task's deadline (timezone-aware); ``None`` means none.

        Raises:
            SuccessorExistsError: the task was retried already.
            ConflictError: ``not_retryable``: the task is not ``FAILED`` or ``CANCELLED``.
            OrbitError: as for every call.
        """
        return self._send(_retry_task(namespace, task_id, reason, deadline))

    def list_attempts(self, namespace: str, task_id: str) -> list[Attempt]:
        """A task's attempts, first generation first (``GET .../tasks/{id}/attempts``)."""
        return self._send(_list_attempts(namespace, task_id))

    def list_task_events(self, namespace: str, task_id: str) -> list[TaskEvent]:
        """A task's history, oldest first (``GET .../tasks/{id}/events``)."""
        return self._send(_list_task_events(namespace, task_id))

    def list_tasks(
        self,
        namespace: str,
        *,
        status: TaskStatus | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """A page of the namespace's tasks, oldest first (``GET /v1/namespaces/{ns}/tasks``).

        Args:
            status, queue: filters; ``None`` means any.
            limit: most tasks on the page, 1-1000. Default 100.
            cursor: the previous page's ``next_cursor``; ``None`` starts at the oldest task.
        """
        return self._send(_list_tasks(namespace, status, queue, limit, cursor))


class AsyncTaskCallsMixin(_SendsAsync):
    """The task calls of :class:`~orbit_client.AsyncOrbitClient` (async twins)."""

    async def submit_task(
        self,
        namespace: str,
        queue: str,
        handler: str,
        params: Any,
        *,
        idempotency_key: str,
        options: SubmitOptions | Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> SubmitResult:
        """Async twin of :meth:`OrbitClient.submit_task` (same arguments, result and errors)."""
        return await self._send(
            _submit_task(namespace, queue, handler, params, idempotency_key, options, traceparent, tracestate)
        )

    async def submit_tasks(
        self, namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
    ) -> list[BatchItemResult]:
        """Async twin of :meth:`OrbitClient.submit_tasks` (same arguments, results and errors)."""
        return await self._send(_submit_tasks(namespace, items))

    async def get_task(self, namespace: str, task_id: str) -> Task:
        """Async twin of :meth:`OrbitClient.get_task`."""
        return await self._send(_get_task(namespace, task_id))

    async def find_submission(self, namespace: str, idempotency_key: str) -> Task | None:
        """Async twin of :meth:`OrbitClient.find_submission` (``None`` on 404 ``submission_not_found``)."""
        return await self._send(_find_submission(namespace, idempotency_key))

    async def get_settings(self) -> ServerInfo:
        """Async twin of :meth:`OrbitClient.get_settings`."""
        return await self._send(_get_settings())

    async def get_queue(self, namespace: str, queue: str) -> Queue:
        """Async twin of :meth:`OrbitClient.get_queue`."""
        return await self._send(_get_queue(namespace, queue))

    async def cancel_task(self, namespace: str, task_id: str, *, reason: str) -> Task:
        """Async twin of :meth:`OrbitClient.cancel_task`."""
        return await self._send(_cancel_task(namespace, task_id, reason))

    async def review_task(
        self,
        namespace: str,
        task_id: str,
        *,
        outcome: str,
        reason: str,
        evidence_ref: str,
        result: JsonValue = None,
        actor: str | None = None,
    ) -> Task:
        """Async twin of :meth:`OrbitClient.review_task`."""
        return await self._send(
            _review_task(namespace, task_id, outcome, reason, evidence_ref, result, actor)
        )

    async def retry_task(
        self, namespace: str, task_id: str, *, reason: str, deadline: datetime | None = None
    ) -> Task:
        """Async twin of :meth:`OrbitClient.retry_task`."""
        return await self._send(_retry_task(namespace, task_id, reason, deadline))

    async def list_attempts(self, namespace: str, task_id: str) -> list[Attempt]:
        """Async twin of :meth:`OrbitClient.list_attempts`."""
        return await self._send(_list_attempts(namespace, task_id))

    async def list_task_events(self, namespace: str, task_id: str) -> list[TaskEvent]:
        """Async twin of :meth:`OrbitClient.list_task_events`."""
        return await self._send(_list_task_events(namespace, task_id))

    async def list_tasks(
        self,
        namespace: str,
        *,
        status: TaskStatus | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Async twin of :meth:`OrbitClient.list_tasks`."""
        return await self._send(_list_tasks(namespace, status, queue, limit, cursor))
