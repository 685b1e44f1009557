"""Wire models of execution: leases, attempts and their reports, one by one and batched.

README "Writing a worker" and "HTTP API"; DESIGN §4 (leases and fencing).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
)

from orbit_client._exceptions import _api_error
from orbit_client._models import NAME_PATTERN, JsonData, LeaseSeconds, UTCDateTime, _Wire
from orbit_client._problem import Problem
from orbit_client._task_models import Task, TaskStatus

__all__ = [
    "MAX_ATTEMPT_BATCH_ITEMS",
    "TRACEBACK_MAX_LENGTH",
    "Attempt",
    "AttemptBatchResponse",
    "AttemptError",
    "AttemptItemResult",
    "AttemptLease",
    "AttemptState",
    "AttemptStatus",
    "BatchLease",
    "CompleteBatch",
    "CompleteItem",
    "CompleteRequest",
    "FailBatch",
    "FailItem",
    "FailRequest",
    "HeartbeatBatch",
    "HeartbeatItem",
    "HeartbeatRequest",
    "LeaseGrant",
    "LeaseRequest",
    "LeaseTokenRequest",
    "StartBatch",
    "StartItem",
]


# --------------------------------------------------------------------------------------------------
# Execution: leases, attempts, cancel, review, manual retry (DESIGN §4, §2-§3 of the reliability model)


class AttemptStatus(enum.StrEnum):
    """What became of one execution attempt.

    ``LEASED`` and ``RUNNING`` are live (the attempt holds the task's lease); the others
    are final and never change again. ``EXPIRED``: the lease ran out before the worker
    reported; a report that arrives later is kept as evidence only (``late_report``).
    """

    LEASED = "LEASED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"

    @property
    def is_live(self) -> bool:
        """``True`` for ``LEASED`` and ``RUNNING``."""
        return self in (AttemptStatus.LEASED, AttemptStatus.RUNNING)


class LeaseRequest(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/queues/{queue}/leases``.

    Attributes:
        worker_id: names the worker process, for operators (1-255 characters); not a secret.
        max_tasks: most tasks granted by this call, 1-100.
        lease_seconds: how long each grant stays valid without a heartbeat, in seconds,
            judged by the database clock. Default 30.
        wait_seconds: long-poll: when nothing is due, wait up to this many seconds for a
            task before answering with an empty list; 0 (the default) answers at once.
        start: *lease-and-start* (README "Workers"): grant the tasks declared ``retry_safe``
            already ``RUNNING`` (the others ``LEASED``, to be started explicitly), for a
            worker that starts their handlers at once, so no ``start`` call is needed. Such an
            attempt is unconfirmed until its first heartbeat or ``complete``; one whose lease
            lapses unconfirmed (its answer was lost) is settled as a never-started one: the task
            waits again, or fails when its attempts are spent, never ``NEEDS_REVIEW``. Default
            ``False``: grants are ``LEASED`` and each start is confirmed by its own call.
    """

    worker_id: str = Field(min_length=1, max_length=255)
    max_tasks: StrictInt = Field(default=1, ge=1, le=100)
    lease_seconds: LeaseSeconds = 30.0
    wait_seconds: StrictFloat = Field(default=0.0, ge=0, le=60, allow_inf_nan=False)
    start: StrictBool = False


class BatchLease(_Wire):
    """The lease request a ``complete``/``fail`` batch may carry (*report-and-lease*, README "Workers").

    Answered in the same response as the reports (``AttemptBatchResponse.grants``): the reports
    are committed first, in their own transaction, and the grants made after, so a grant that
    fails (``AttemptBatchResponse.lease_error``) never undoes a report. No long-poll: a report's
    answer never waits for tasks to come due.

    Attributes:
        queue: the queue to lease from (in the batch's namespace).
        worker_id, max_tasks, lease_seconds, start: as in :class:`LeaseRequest`.
    """

    queue: str = Field(pattern=NAME_PATTERN)
    worker_id: str = Field(min_length=1, max_length=255)
    max_tasks: StrictInt = Field(default=1, ge=1, le=100)
    lease_seconds: LeaseSeconds = 30.0
    start: StrictBool = False


class AttemptLease(_Wire):
    """The execution grant of one attempt, as handed to the worker that leased it.

    Attributes:
        id: the attempt id; every attempt call names it.
        generation: the fencing number: 1 for the task's first attempt, one more for each
            later attempt. Pass it to the resources the handler touches so they can refuse
            a stale attempt's writes (§3 of the reliability model).
        lease_token: the secret that proves this grant; send it with every attempt call.
            Only its SHA-256 is stored on the server.
        lease_expires_at: when the grant lapses (UTC, database clock) unless renewed by
            ``start`` or ``heartbeat``.
    """

    id: str
    generation: int
    lease_token: str
    lease_expires_at: UTCDateTime


class LeaseGrant(_Wire):
    """One element of a lease answer: the task and its new attempt."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    task: Task
    attempt: AttemptLease


class LeaseTokenRequest(_Wire):
    """Body of ``POST .../attempts/{id}/start``: the attempt's lease token."""

    lease_token: str = Field(min_length=1, max_length=255)


class HeartbeatRequest(_Wire):
    """Body of ``POST .../attempts/{id}/heartbeat``.

    Attributes:
        lease_token: the attempt's lease token.
        lease_seconds: the new lease, in seconds from now (database clock); ``None`` means
            the duration asked for when the task was leased.
    """

    lease_token: str = Field(min_length=1, max_length=255)
    lease_seconds: LeaseSeconds | None = None


class CompleteRequest(_Wire):
    """Body of ``POST .../attempts/{id}/complete``: the token and the handler's JSON result.

    Sending the same body again answers 200 with the same state, so a worker may
    repeat a ``complete`` whose answer it did not receive.
    """

    lease_token: str = Field(min_length=1, max_length=255)
    result: JsonData = None


#: Longest ``AttemptError.traceback`` accepted, in characters (16 KiB). The worker SDK keeps the
#: end of a longer traceback (the innermost frames and the exception line) and marks the cut.
TRACEBACK_MAX_LENGTH = 16 * 1024


class AttemptError(_Wire):
    """Why an attempt failed, as the worker reports it.

    Attributes:
        type: a short machine-readable kind, e.g. the exception class name
            (``"TimeoutError"``), or ``"cancelled"`` for a handler that stopped because
            cancellation was requested.
        message: a human-readable explanation (at most 10 000 characters).
        retryable: ``True`` declares that running the handler again is safe and may
            succeed; the server then schedules another attempt while the budget and the
            deadline allow.
        traceback: the handler's formatted Python traceback, at most
            :data:`TRACEBACK_MAX_LENGTH` characters, or ``None``. The worker SDK sends it with
            every handler exception; the server stores it in the attempt's and the task's
            ``error`` (shown by ``orbit-server task show`` and the console). ``None`` is left
            out of the JSON, so an error without one reads as before.
    """

    type: str = Field(min_length=1, max_length=255)
    message: str = Field(default="", max_length=10_000)
    retryable: StrictBool = False
    traceback: str | None = Field(default=None, max_length=TRACEBACK_MAX_LENGTH)

    @model_serializer(mode="wrap")
    def _leave_out_no_traceback(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("traceback") is None:
            data.pop("traceback", None)
        return data

    @staticmethod
    def bounded_traceback(text: str, limit: int = TRACEBACK_MAX_LENGTH) -> str:
        """``text`` if it has at most ``limit`` characters (``limit`` >= 100); else its end after a
        first line ``... [N characters cut]``: at most ``limit`` characters in all. The end of a
        traceback (innermost frames, the exception) is the informative part; it starts at the first
        whole frame (a ``  File ...`` line) in it, else at a line start."""
        if len(text) <= limit:
            return text
        tail = text[-(limit - 40) :]  # 40 leaves room for the marker line
        frame = tail.find("\n  File ")
        newline = frame if frame >= 0 else tail.find("\n")
        if 0 <= newline < len(tail) - 1:
            tail = tail[newline + 1 :]
        return f"... [{len(text) - len(tail)} characters cut]\n{tail}"


class FailRequest(_Wire):
    """Body of ``POST .../attempts/{id}/fail``; repeating the same body answers 200 again."""

    lease_token: str = Field(min_length=1, max_length=255)
    error: AttemptError


class AttemptState(_Wire):
    """The answer to every attempt call.

    Attributes:
        attempt_id, task_id, generation: which attempt this is.
        status: the attempt's status after the call.
        task_status: the task's status after the call.
        lease_expires_at: when the lease lapses (UTC) while the attempt is live; for a
            finished attempt, when it lapsed or would have.
        cancel_requested: ``True`` when cancellation of the task was requested: the handler
            should stop and report ``fail`` with error type ``"cancelled"``.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    attempt_id: str
    task_id: str
    generation: int
    status: AttemptStatus
    task_status: TaskStatus
    lease_expires_at: UTCDateTime
    cancel_requested: bool = False


#: Most items in one batched attempt call (``POST .../attempts/start`` etc.); more is a 422.
MAX_ATTEMPT_BATCH_ITEMS = 500

#: An attempt id as the batched calls accept it.
AttemptId = Annotated[str, Field(min_length=1, max_length=64)]
#: A task id as a batch item names it (``StartItem.task_id``).
_TaskId = Annotated[str, Field(min_length=1, max_length=64)]


class _NamesItsTask(BaseModel):
    """A batch item that may name its attempt's task (``task_id``), as the lease granted it.

    Optional: with it, a server that offers it (``ServerInfo.item_task_ids``) locks the batch's tasks
    without first reading which they are (a statement less for a batch written set-based). A wrong task id
    costs nothing but that: the item is then answered as without it. Left out of the request body when
    ``None``, so that a server that predates the field accepts the item."""

    task_id: _TaskId | None = None

    @model_serializer(mode="wrap")
    def _without_absent_task(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if self.task_id is None and isinstance(data, dict):
            data.pop("task_id", None)
        return data


class StartItem(_NamesItsTask, LeaseTokenRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/start``: which attempt, and its token; optionally its
    task (``task_id``, see :class:`CompleteItem`)."""

    attempt_id: AttemptId


class HeartbeatItem(HeartbeatRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/heartbeat`` (fields of :class:`HeartbeatRequest`)."""

    attempt_id: AttemptId


class CompleteItem(_NamesItsTask, CompleteRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/complete`` (fields of :class:`CompleteRequest`).

    Attributes:
        attempt_id: which attempt.
        task_id: optional: the attempt's task (``LeaseGrant.task.id``). A server that offers it
            (``ServerInfo.item_task_ids``) then locks the batch's tasks without first reading which
            they are; a wrong one only loses that. Not sent when ``None``.
    """

    attempt_id: AttemptId


class FailItem(FailRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/fail`` (fields of :class:`FailRequest`)."""

    attempt_id: AttemptId


class StartBatch(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/attempts/start``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS` items."""

    items: list[StartItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)


class HeartbeatBatch(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/attempts/heartbeat``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS` items."""

    items: list[HeartbeatItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)


class CompleteBatch(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/attempts/complete``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS`
    items, and optionally the worker's next lease request (:class:`BatchLease`)."""

    items: list[CompleteItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)
    lease: BatchLease | None = None


class FailBatch(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/attempts/fail``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS`
    items, and optionally the worker's next lease request (:class:`BatchLease`)."""

    items: list[FailItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)
    lease: BatchLease | None = None


class AttemptItemResult(BaseModel):
    """The outcome of one item of a batched attempt call, in request order.

    Each item is its own conditional transition, fenced exactly like the single call
    (``POST .../attempts/{id}/start`` etc.), and one item's refusal never undoes another's.

    Attributes:
        status: ``200`` (done, or an equal repeat), ``404`` (``attempt_not_found``) or ``409``
            (``lease_lost``, ``invalid_transition``, ``concurrent_update``): the status the
            single call would have answered.
        attempt: the attempt's state after the call when ``status == 200``, else ``None``.
        error: the problem body the single call would have answered, else ``None``.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: int
    attempt: AttemptState | None = None
    error: Problem | None = None

    def raise_for_status(self) -> AttemptState:
        """The attempt's state; raise what the single call would have raised for an error item.

        Raises:
            LeaseLostError, InvalidTransitionError, ConcurrentUpdateError, NotFoundError, ...:
                the :class:`~orbit_client.OrbitAPIError` subclass for ``status`` and
                ``error.code``, with the problem attached (``evidence_recorded`` and so on).
        """
        if self.status == 200 and self.attempt is not None:
            return self.attempt
        problem = self.error
        if problem is None:
            raise _api_error("batch item failed", self.status, f"http_{self.status}")
        raise _api_error(
            "batch item failed",
            self.status,
            problem.code,
            title=problem.title,
            detail=problem.detail,
            request_id=problem.request_id,
            problem=problem,
        )


class AttemptBatchResponse(BaseModel):
    """The answer (200) to a batched attempt call: one :class:`AttemptItemResult` per item, in order.

    Attributes:
        items: the item results.
        grants: when the batch carried a lease request (:class:`BatchLease`), its grants (empty
            when nothing was due); absent otherwise.
        lease_error: when that lease request failed after the reports were committed, why (the
            problem a lease call would have answered, e.g. 404 ``queue_not_found``); else absent.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    items: list[AttemptItemResult]
    grants: list[LeaseGrant] = Field(default_factory=list)
    lease_error: Problem | None = None


class Attempt(_Wire):
    """One execution attempt of a task, as ``GET .../tasks/{id}/attempts`` lists it (no token).

    ``late_report`` holds a ``complete`` or ``fail`` body that arrived after the attempt
    had lost its lease, kept as evidence for a review; it never changes the task.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    task_id: str
    generation: int
    worker_id: str
    status: AttemptStatus
    leased_at: UTCDateTime
    started_at: UTCDateTime | None = None
    heartbeat_at: UTCDateTime | None = None
    lease_expires_at: UTCDateTime
    finished_at: UTCDateTime | None = None
    result: JsonValue = None
    error: JsonValue = None
    late_report: JsonValue = None
    late_reported_at: UTCDateTime | None = None
