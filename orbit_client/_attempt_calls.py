"""Execution calls of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient`:
lease tasks, then start, heartbeat, complete or fail their attempts, one by one or batched
(DESIGN §4; README "Workers").

Each call is one function that builds its :class:`~orbit_client._calls._Call` (no I/O); the two
mixins send it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, JsonValue

from orbit_client._attempt_models import (
    MAX_ATTEMPT_BATCH_ITEMS,
    AttemptBatchResponse,
    AttemptError,
    AttemptItemResult,
    AttemptState,
    BatchLease,
    CompleteBatch,
    CompleteItem,
    CompleteRequest,
    FailBatch,
    FailItem,
    FailRequest,
    HeartbeatBatch,
    HeartbeatItem,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseTokenRequest,
    StartBatch,
    StartItem,
)
from orbit_client._calls import (
    _body,
    _Call,
    _invalid_response,
    _many,
    _model,
    _one,
    _parse_model,
    _path,
    _Sends,
    _SendsAsync,
    _validated,
)
from orbit_client._exceptions import OrbitUsageError

__all__: list[str] = []

#: The batched attempt calls: action → (batch body model, item model).
_ATTEMPT_BATCHES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "start": (StartBatch, StartItem),
    "heartbeat": (HeartbeatBatch, HeartbeatItem),
    "complete": (CompleteBatch, CompleteItem),
    "fail": (FailBatch, FailItem),
}
#: What each batched call accepts as one item: the item model, or a mapping of its fields.
StartItems = Sequence[StartItem | Mapping[str, Any]]
HeartbeatItems = Sequence[HeartbeatItem | Mapping[str, Any]]
CompleteItems = Sequence[CompleteItem | Mapping[str, Any]]
FailItems = Sequence[FailItem | Mapping[str, Any]]


def _lease_tasks(
    namespace: str, queue: str, worker_id: str, max_tasks: int, lease_seconds: float, wait_seconds: float,
    start: bool = False,
) -> _Call[list[LeaseGrant]]:  # fmt: skip
    """``POST .../queues/{queue}/leases``: not retried; the timeout grows by the long poll."""
    path = _path("/v1/namespaces/{}/queues/{}/leases", namespace, queue)
    body = _body(
        LeaseRequest,
        "lease request",
        worker_id=worker_id,
        max_tasks=max_tasks,
        lease_seconds=lease_seconds,
        wait_seconds=wait_seconds,
        start=start,
    )
    if not start:  # no "start" key at all: a server that predates lease-and-start accepts the body
        body.pop("start", None)
    return _Call("POST", path, _many(LeaseGrant), json=body, retry=False, extra_timeout=wait_seconds)


def _attempt_call(
    namespace: str, attempt_id: str, action: str, model: type[BaseModel], **fields: Any
) -> _Call[AttemptState]:
    """``POST .../attempts/{id}/{action}``: every report is safe to repeat, so it is retried."""
    path = _path("/v1/namespaces/{}/attempts/{}/" + action, namespace, attempt_id)
    return _Call("POST", path, _one(AttemptState), json=_body(model, f"{action} request", **fields))


def _start_attempt(namespace: str, attempt_id: str, lease_token: str) -> _Call[AttemptState]:
    return _attempt_call(namespace, attempt_id, "start", LeaseTokenRequest, lease_token=lease_token)


def _heartbeat(
    namespace: str, attempt_id: str, lease_token: str, lease_seconds: float | None
) -> _Call[AttemptState]:
    fields: dict[str, Any] = {"lease_token": lease_token}
    if lease_seconds is not None:
        fields["lease_seconds"] = lease_seconds
    return _attempt_call(namespace, attempt_id, "heartbeat", HeartbeatRequest, **fields)


def _complete_attempt(
    namespace: str, attempt_id: str, lease_token: str, result: JsonValue
) -> _Call[AttemptState]:
    return _attempt_call(
        namespace, attempt_id, "complete", CompleteRequest, lease_token=lease_token, result=result
    )


def _fail_attempt(
    namespace: str, attempt_id: str, lease_token: str, error: AttemptError | Mapping[str, Any]
) -> _Call[AttemptState]:
    error = error if isinstance(error, AttemptError) else _model(AttemptError, error, "error")
    return _attempt_call(namespace, attempt_id, "fail", FailRequest, lease_token=lease_token, error=error)


def _as_field(value: BaseModel | Mapping[str, Any], model: type[BaseModel]) -> Any:
    """``value`` as a field of a batch body: an instance of exactly ``model`` as it is (valid already, and
    pydantic does not validate a model instance again), a subclass's as its fields, as a mapping is."""
    if type(value) is model:
        return value
    return value.model_dump(mode="json") if isinstance(value, model) else value


def _attempt_batch(
    namespace: str, action: str, items: Sequence[BaseModel | Mapping[str, Any]]
) -> _Call[list[AttemptItemResult]]:
    """``POST /v1/namespaces/{ns}/attempts/{action}`` (a batch). Sends nothing.

    Raises :class:`OrbitUsageError` for a bad item (naming its index and field, never its
    values), no item, or more than :data:`MAX_ATTEMPT_BATCH_ITEMS`.
    """
    call = _attempt_batch_answer(namespace, action, items, None)
    parse = call.parse
    return _Call("POST", call.path, lambda response: parse(response).items, content=call.content)


def _attempt_batch_answer(
    namespace: str, action: str, items: Sequence[BaseModel | Mapping[str, Any]],
    lease: BatchLease | Mapping[str, Any] | None,
) -> _Call[AttemptBatchResponse]:  # fmt: skip
    """A batch, optionally carrying a lease request (report-and-lease): the whole answer."""
    batch_model, item_model = _ATTEMPT_BATCHES[action]
    if isinstance(items, Mapping | str | bytes) or not isinstance(items, Sequence):
        raise OrbitUsageError(f"items is a sequence of {item_model.__name__} or mappings; nothing was sent")
    if not 1 <= len(items) <= MAX_ATTEMPT_BATCH_ITEMS:
        raise OrbitUsageError(
            f"a batch has 1 to {MAX_ATTEMPT_BATCH_ITEMS} items, not {len(items)}; nothing was sent"
        )
    path = _path("/v1/namespaces/{}/attempts/" + action, namespace)
    fields: dict[str, Any] = {"items": [_as_field(item, item_model) for item in items]}
    if lease is not None:
        fields["lease"] = _as_field(lease, BatchLease)
    batch = _validated(batch_model, f"{action} batch", **fields)
    # Encoded once, by pydantic, as orbit_client._reports measures each item when it splits a batch by
    # size: the bytes measured are the bytes sent (httpx before 0.28 encodes json= with ensure_ascii and
    # spaces, up to twice as large for non-ASCII text). No "lease" key at all without one: a server that
    # predates report-and-lease accepts the body.
    alone = batch.model_dump_json(exclude={"lease"}).encode()
    # A lease is granted once: a try after the first carries the reports alone. Its grants, had the first
    # try's answer been lost after the server committed them, would otherwise be granted again on every
    # retry, each set lapsing unused and spending an attempt of each task (the reports are safe to repeat).
    content, retry_content = (alone, None) if lease is None else (batch.model_dump_json().encode(), alone)
    sent = len(items)

    def parse(response: httpx.Response) -> AttemptBatchResponse:
        """A 200 batch answer with one item result per item sent, else :class:`OrbitAPIError`."""
        answer = _parse_model(AttemptBatchResponse, response)
        if len(answer.items) != sent:
            raise _invalid_response(
                response,
                f"the server answered {len(answer.items)} results for {sent} items; the items may have been "
                "performed; check that the client and server versions match",
            )
        return answer

    return _Call("POST", path, parse, content=content, retry_content=retry_content)


class AttemptCallsMixin(_Sends):
    """The execution calls of :class:`~orbit_client.OrbitClient`."""

    def lease_tasks(
        self,
        namespace: str,
        queue: str,
        *,
        worker_id: str,
        max_tasks: int = 1,
        lease_seconds: float = 30.0,
        wait_seconds: float = 0.0,
        start: bool = False,
    ) -> list[LeaseGrant]:
        """Lease up to ``max_tasks`` due tasks (``POST /v1/namespaces/{ns}/queues/{queue}/leases``).

        Each grant is the task and its new attempt: ``id``, ``generation`` (the fencing
        number), the secret ``lease_token`` and ``lease_expires_at`` (UTC, server's database
        clock). Needs a ``work`` key. Not retried by the client: a lease whose answer was lost
        leaves its grants unused until they expire (the worker loop retries instead).

        Args:
            worker_id: names this worker process (1-255 characters), for operators.
            max_tasks: most grants, 1-100. Default 1.
            lease_seconds: lease duration in seconds (0.1-3600); renew it with
                :meth:`start_attempt` and :meth:`heartbeat`. Default 30.
            wait_seconds: long-poll up to this many seconds (0-60) when nothing is due; the
                request's timeout is extended by as much. Default 0: answer at once.
            start: *lease-and-start*: the grants come back already ``RUNNING`` (no
                :meth:`start_attempt`); the attempt's first heartbeat or ``complete`` confirms it, and
                one never confirmed lapses as never started (README "Workers"). Needs a server whose
                :meth:`get_settings` says ``lease_and_start``. Default ``False``.

        Returns:
            The grants, oldest task first; empty when nothing is due.

        Raises:
            OrbitUsageError: an argument is out of range; nothing was sent.
            NotFoundError: no such queue or namespace.
            OrbitError: as for every call.
        """
        return self._send(
            _lease_tasks(namespace, queue, worker_id, max_tasks, lease_seconds, wait_seconds, start)
        )

    def start_attempt(self, namespace: str, attempt_id: str, lease_token: str) -> AttemptState:
        """Confirm that the handler starts: task ``LEASED → RUNNING``, lease renewed.

        Safe to repeat (a running attempt answers its state again), so it is retried.

        Raises:
            LeaseLostError: wrong token, or the attempt no longer holds the lease (do not run it).
            NotFoundError: no such attempt in the namespace.
            OrbitError: as for every call.
        """
        return self._send(_start_attempt(namespace, attempt_id, lease_token))

    def heartbeat(
        self, namespace: str, attempt_id: str, lease_token: str, *, lease_seconds: float | None = None
    ) -> AttemptState:
        """Renew the attempt's lease; the answer's ``cancel_requested`` says whether to stop.

        Args:
            lease_seconds: the new lease in seconds from now (server's database clock);
                ``None`` keeps the duration asked for at lease time.

        Raises:
            LeaseLostError: wrong token, or the attempt no longer holds the lease: stop working.
            OrbitError: as for every call.
        """
        return self._send(_heartbeat(namespace, attempt_id, lease_token, lease_seconds))

    def complete_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, result: JsonValue
    ) -> AttemptState:
        """Report success with a JSON ``result``: attempt and task ``SUCCEEDED``.

        Retried on retryable errors: the server answers a repeat with the same token and an
        equal result with the same state.

        Raises:
            LeaseLostError: the attempt no longer holds the lease; the task was not changed and the
                result was kept on the attempt as evidence (``evidence_recorded``).
            InvalidTransitionError: the attempt was never started.
            OrbitError: as for every call.
        """
        return self._send(_complete_attempt(namespace, attempt_id, lease_token, result))

    def fail_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, error: AttemptError | Mapping[str, Any]
    ) -> AttemptState:
        """Report failure. The task is retried (``error.retryable`` and budget left), fails, or,
        after a cancel request, becomes ``CANCELLED``.

        Args:
            error: :class:`AttemptError` or a mapping of its fields (``type``, ``message``,
                ``retryable``); use type ``"cancelled"`` when stopping because of a cancel request.

        Raises:
            LeaseLostError: as for :meth:`complete_attempt`.
            OrbitError: as for every call.
        """
        return self._send(_fail_attempt(namespace, attempt_id, lease_token, error))

    def start_attempts(self, namespace: str, items: StartItems) -> list[AttemptItemResult]:
        """Confirm the start of many attempts in one request (``POST /v1/namespaces/{ns}/attempts/start``).

        Each item is exactly :meth:`start_attempt` for its attempt, run on the server as its own
        conditional transition: one item's refusal never undoes another's.

        Args:
            items: 1 to :data:`~orbit_client.MAX_ATTEMPT_BATCH_ITEMS` (500) :class:`StartItem`
                (``attempt_id``, ``lease_token``) or mappings of its fields.

        Returns:
            One :class:`AttemptItemResult` per item, in order: ``status`` 200 with ``attempt``,
            or 404/409 with the ``error`` problem :meth:`start_attempt` would have raised
            (``result.raise_for_status()`` raises it: :class:`LeaseLostError` etc.).

        Raises:
            OrbitUsageError: no item, too many, or an invalid one; nothing was sent.
            NotFoundError: ``not_found`` when the server predates batched attempt calls
                (upgrade it, or use the single calls); ``namespace_not_found`` for another namespace.
            OrbitError: as for every call, for the request as a whole. Retried like
                :meth:`start_attempt`: every item is safe to repeat.
        """
        return self._send(_attempt_batch(namespace, "start", items))

    def heartbeats(self, namespace: str, items: HeartbeatItems) -> list[AttemptItemResult]:
        """Renew many leases in one request (``POST /v1/namespaces/{ns}/attempts/heartbeat``).

        Each item is exactly :meth:`heartbeat` (``attempt_id``, ``lease_token``, optional
        ``lease_seconds``); an item's ``attempt.cancel_requested`` says whether its handler
        should stop. Results, errors and retries as for :meth:`start_attempts`.
        """
        return self._send(_attempt_batch(namespace, "heartbeat", items))

    def complete_attempts(self, namespace: str, items: CompleteItems) -> list[AttemptItemResult]:
        """Report many successes in one request (``POST /v1/namespaces/{ns}/attempts/complete``).

        Each item is exactly :meth:`complete_attempt` (``attempt_id``, ``lease_token``, JSON
        ``result``): an item refused with ``lease_lost`` had its result kept as evidence when
        its ``error.evidence_recorded`` is true. Results, errors and retries as for
        :meth:`start_attempts` (a repeat with an equal result answers 200 again).
        """
        return self._send(_attempt_batch(namespace, "complete", items))

    def fail_attempts(self, namespace: str, items: FailItems) -> list[AttemptItemResult]:
        """Report many failures in one request (``POST /v1/namespaces/{ns}/attempts/fail``).

        Each item is exactly :meth:`fail_attempt` (``attempt_id``, ``lease_token``, ``error``).
        Results, errors and retries as for :meth:`start_attempts`.
        """
        return self._send(_attempt_batch(namespace, "fail", items))

    def complete_attempts_and_lease(
        self, namespace: str, items: CompleteItems, *, lease: BatchLease | Mapping[str, Any]
    ) -> AttemptBatchResponse:
        """:meth:`complete_attempts` carrying the next lease request (*report-and-lease*, README "Workers").

        The server commits the reports first, then grants (``lease``: a :class:`BatchLease`, its
        queue in this namespace, no long-poll); a grant that fails never undoes a report. Needs a
        server whose :meth:`get_settings` says ``report_and_lease``.

        Returns:
            ``items``: one result per report, as :meth:`complete_attempts` returns them;
            ``grants``: the new grants (empty when nothing was due); ``lease_error``: the problem
            the lease part was refused with (e.g. 404 ``queue_not_found``), else ``None``.

        Raises:
            As :meth:`complete_attempts`, and retried alike, but a retry carries the reports alone:
            its answer has no grants (lease again with :meth:`lease_tasks`). The lease part is sent
            once, as :meth:`lease_tasks` is: the grants of an answer lost on the way lapse unused,
            and are never granted again by a retry.
        """
        return self._send(_attempt_batch_answer(namespace, "complete", items, lease))

    def fail_attempts_and_lease(
        self, namespace: str, items: FailItems, *, lease: BatchLease | Mapping[str, Any]
    ) -> AttemptBatchResponse:
        """:meth:`fail_attempts` carrying the next lease request; as :meth:`complete_attempts_and_lease`."""
        return self._send(_attempt_batch_answer(namespace, "fail", items, lease))


class AsyncAttemptCallsMixin(_SendsAsync):
    """The execution calls of :class:`~orbit_client.AsyncOrbitClient` (async twins)."""

    async def lease_tasks(
        self,
        namespace: str,
        queue: str,
        *,
        worker_id: str,
        max_tasks: int = 1,
        lease_seconds: float = 30.0,
        wait_seconds: float = 0.0,
        start: bool = False,
    ) -> list[LeaseGrant]:
        """Async twin of :meth:`OrbitClient.lease_tasks`."""
        return await self._send(
            _lease_tasks(namespace, queue, worker_id, max_tasks, lease_seconds, wait_seconds, start)
        )

    async def start_attempt(self, namespace: str, attempt_id: str, lease_token: str) -> AttemptState:
        """Async twin of :meth:`OrbitClient.start_attempt`."""
        return await self._send(_start_attempt(namespace, attempt_id, lease_token))

    async def heartbeat(
        self, namespace: str, attempt_id: str, lease_token: str, *, lease_seconds: float | None = None
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.heartbeat`."""
        return await self._send(_heartbeat(namespace, attempt_id, lease_token, lease_seconds))

    async def complete_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, result: JsonValue
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.complete_attempt`."""
        return await self._send(_complete_attempt(namespace, attempt_id, lease_token, result))

    async def fail_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, error: AttemptError | Mapping[str, Any]
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.fail_attempt`."""
        return await self._send(_fail_attempt(namespace, attempt_id, lease_token, error))

    async def start_attempts(self, namespace: str, items: StartItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.start_attempts`."""
        return await self._send(_attempt_batch(namespace, "start", items))

    async def heartbeats(self, namespace: str, items: HeartbeatItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.heartbeats`."""
        return await self._send(_attempt_batch(namespace, "heartbeat", items))

    async def complete_attempts(self, namespace: str, items: CompleteItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.complete_attempts`."""
        return await self._send(_attempt_batch(namespace, "complete", items))

    async def fail_attempts(self, namespace: str, items: FailItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.fail_attempts`."""
        return await self._send(_attempt_batch(namespace, "fail", items))

    async def complete_attempts_and_lease(
        self, namespace: str, items: CompleteItems, *, lease: BatchLease | Mapping[str, Any]
    ) -> AttemptBatchResponse:
        """Async twin of :meth:`OrbitClient.complete_attempts_and_lease`."""
        return await self._send(_attempt_batch_answer(namespace, "complete", items, lease))

    async def fail_attempts_and_lease(
        self, namespace: str, items: FailItems, *, lease: BatchLease | Mapping[str, Any]
    ) -> AttemptBatchResponse:
        """Async twin of :meth:`OrbitClient.fail_attempts_and_lease`."""
        return await self._send(_attempt_batch_answer(namespace, "fail", items, lease))
