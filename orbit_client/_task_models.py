"""Wire models of tasks: submission (one and batched), the task, its events and pages, cancel, review, retry.

README "Using the client" and "HTTP API"; the shared validators are in :mod:`._models`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from orbit_client._models import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    NAME_PATTERN,
    JsonData,
    UTCDateTime,
    _Wire,
    canonical_json,
    is_valid_idempotency_key,
)
from orbit_client._problem import Problem

__all__ = [
    "BatchItem",
    "BatchItemResult",
    "BatchSubmission",
    "BatchSubmitResponse",
    "CancelRequest",
    "RetryRequest",
    "ReviewRequest",
    "SubmitOptions",
    "SubmitResult",
    "Task",
    "TaskEvent",
    "TaskPage",
    "TaskStatus",
    "TaskSubmission",
]


class TaskStatus(enum.StrEnum):
    """The task states of §2 of the reliability model (seed 001)."""

    WAITING = "WAITING"
    LEASED = "LEASED"
    RUNNING = "RUNNING"
    NEEDS_REVIEW = "NEEDS_REVIEW"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        """``True`` for ``SUCCEEDED``, ``FAILED`` and ``CANCELLED``."""
        return self in (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED)


class SubmitOptions(_Wire):
    """Per-task execution options of a submission. Every field is optional.

    Attributes:
        max_attempts: how many attempts the task may use, 1-1000; ``None`` means the
            server's default (3).
        available_at: earliest time (UTC) the task may be leased; ``None`` means now.
        deadline: time (UTC) after which the task is not started again and ends
            ``FAILED`` with ``deadline_exceeded``; ``None`` means no deadline.
        retry_safe: ``True`` declares that the handler may safely run again after an
            attempt whose outcome is unknown; ``None`` means ``False``.
        backoff_base_seconds: delay before the first retry after a retryable failure, in
            seconds; it doubles for each later retry. ``None`` means 1 s.
        backoff_cap_seconds: the longest such delay, in seconds; ``None`` means 300 s. The
            delay before retry *n* is ``d/2 + uniform(0, d/2)`` with
            ``d = min(cap, base * 2**(n-1))`` (equal jitter), added to the database clock.
        concurrency_key: a business key (1-255 printable ASCII characters, e.g. a customer id)
            whose live attempts the queue's ``max_concurrency_per_key`` limits (README
            "Concurrency limits and pausing a queue"); ``None`` means the task has none.
        priority: an integer from -100 to 100 (the range of ``django.tasks``); a lease grants the
            highest priority first, then the oldest due (README "Task priority"). ``None`` means 0.
    """

    max_attempts: StrictInt | None = Field(default=None, ge=1, le=1000)
    available_at: UTCDateTime | None = None
    deadline: UTCDateTime | None = None
    retry_safe: StrictBool | None = None
    backoff_base_seconds: StrictFloat | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)
    backoff_cap_seconds: StrictFloat | None = Field(default=None, ge=0, le=7 * 86400, allow_inf_nan=False)
    concurrency_key: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")
    # Left out of the JSON when None, so an answer carrying options (a schedule's) parses in older clients.
    priority: StrictInt | None = Field(default=None, ge=-100, le=100, exclude_if=lambda value: value is None)


class TaskSubmission(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/tasks``.

    ``params`` is any JSON value (finite numbers, valid Unicode, at most
    :data:`JSON_MAX_DEPTH` levels deep); it is stored and returned unchanged. Left out, it
    is ``{}`` (README "HTTP API"), and a submission without ``params`` means, and digests,
    exactly as one with ``"params": {}``.
    """

    queue: str = Field(pattern=NAME_PATTERN)
    handler: str = Field(min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")
    params: JsonData = Field(default_factory=dict)
    options: SubmitOptions | None = None

    def canonical_meaning(self) -> dict[str, Any]:
        """What the submission means, as plain JSON data, for the request digest.

        Options left at ``None`` are dropped, so ``{}`` and a missing ``options``
        mean the same thing and digest the same; so is ``retry_safe: false``, which is
        what ``None`` means, and ``priority: 0``. Integral numbers are written as integers (RFC 8785), so
        ``1`` and ``1.0`` digest alike.
        """
        options = self.options.model_dump(mode="json", exclude_none=True) if self.options else {}
        if options.get("retry_safe") is False:
            del options["retry_safe"]
        if options.get("priority") == 0:
            del options["priority"]
        return {
            "queue": self.queue,
            "handler": self.handler,
            "params": canonical_json(self.params),
            "options": canonical_json(options),
        }


class Task(_Wire):
    """A task as the server reports it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    namespace: str
    queue: str
    handler: str
    params: JsonValue = None
    status: TaskStatus
    state_version: int
    attempt_count: int
    max_attempts: int
    retry_safe: bool = False
    available_at: UTCDateTime
    deadline: UTCDateTime | None = None
    cancel_requested: bool = False
    result: JsonValue = None
    error: JsonValue = None
    retry_of: str | None = None
    created_at: UTCDateTime
    updated_at: UTCDateTime
    #: The newest attempt (the live one while ``LEASED``/``RUNNING``); ``None`` before the first lease.
    current_attempt_id: str | None = None
    cancel_reason: str | None = None
    backoff_base_seconds: float | None = None
    backoff_cap_seconds: float | None = None
    #: When the task reached ``SUCCEEDED``, ``FAILED`` or ``CANCELLED``; ``None`` before.
    finished_at: UTCDateTime | None = None
    #: The business key the queue's ``max_concurrency_per_key`` limits; ``None`` if none.
    concurrency_key: str | None = None
    #: -100..100: a lease grants the highest first, then the oldest due (README "Task priority").
    priority: int = 0
    #: The W3C ``traceparent`` the submission carried (README "Tracing"); ``None`` when none was given.
    traceparent: str | None = None
    #: The W3C ``tracestate`` that came with ``traceparent``; ``None`` when none was given.
    tracestate: str | None = None


class SubmitResult(BaseModel):
    """What :meth:`OrbitClient.submit_task` returns.

    Attributes:
        task: the task the idempotency key names (on a replay, the original task).
        replayed: ``True`` when the server answered with the result of an earlier
            submission with the same key (``Idempotent-Replayed: true``).
    """

    model_config = ConfigDict(frozen=True)

    task: Task
    replayed: bool


# --------------------------------------------------------------------------------------------------
# Batch acceptance: POST /v1/namespaces/{ns}/tasks/batch (DESIGN §3 "Batch acceptance")


def _check_idempotency_key(value: str) -> str:
    if not is_valid_idempotency_key(value):
        raise ValueError(
            "an idempotency key is 1-255 printable ASCII characters (0x20-0x7E) without leading or "
            "trailing spaces"
        )
    return value


#: An idempotency key as a JSON string field: the same rule as the ``Idempotency-Key`` header.
_IdempotencyKey = Annotated[
    str, Field(min_length=1, max_length=IDEMPOTENCY_KEY_MAX_LENGTH), AfterValidator(_check_idempotency_key)
]


class BatchItem(_Wire):
    """One item of ``POST /v1/namespaces/{ns}/tasks/batch``: a submission with its own key.

    The fields are those of :class:`TaskSubmission` plus the idempotency key that the
    single endpoint takes as a header. The server applies exactly the single endpoint's
    rules to each item (same request digest, replay, ``idempotency_key_reused``).

    Attributes:
        idempotency_key: 1-255 printable ASCII characters (0x20-0x7E), no leading or
            trailing space (the ``Idempotency-Key`` rule, README "HTTP API"). The server checks it
            per item, so one malformed key fails only its item (400).
        queue, handler, params, options: as in :class:`TaskSubmission` (``params`` left
            out is ``{}``).
        traceparent, tracestate: the item's W3C Trace Context (what the single endpoint takes
            as the ``traceparent``/``tracestate`` headers), stored with the task and handed
            out with its lease (README "Tracing"); ``None``: none. Not part of the request
            digest; a server ignores a malformed one.
    """

    idempotency_key: _IdempotencyKey
    queue: str = Field(pattern=NAME_PATTERN)
    handler: str = Field(min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")
    params: JsonData = Field(default_factory=dict)
    options: SubmitOptions | None = None
    traceparent: str | None = Field(default=None, max_length=55)
    tracestate: str | None = Field(default=None, max_length=512)

    def submission(self) -> TaskSubmission:
        """The item without its key, as the single endpoint's body (its digest is the same)."""
        return TaskSubmission(
            queue=self.queue, handler=self.handler, params=self.params, options=self.options
        )


class BatchSubmission(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/tasks/batch``: ``{"items": [BatchItem, ...]}``.

    1 to ``ORBIT_MAX_BATCH_ITEMS`` items (default 500), within the body size limit
    (``ORBIT_MAX_BODY_BYTES``). Two items may carry the same key: they are handled as two
    single submissions one after the other (the second replays the first, or is refused
    with ``idempotency_key_reused`` if it asks for something else).
    """

    items: list[BatchItem] = Field(min_length=1)


class BatchItemResult(BaseModel):
    """The answer for one item of a batch submission (one per item, in request order).

    Attributes:
        status: what the single endpoint would have answered for this item: ``201`` a new
            task; ``200`` a replay of an earlier submission with the same key and request
            (``replayed`` is ``True``); ``400`` a missing or malformed idempotency key
            (``idempotency_key_missing``/``idempotency_key_invalid``); ``404``
            ``queue_not_found``; ``410`` ``task_purged`` (the key's task was purged; the
            problem's ``task_id`` names it); ``409`` ``request_in_progress`` (another request with the
            key had not committed; retry the item with the same key); ``422``
            ``idempotency_key_reused`` or ``validation_error`` (the item is not a valid
            submission; ``error.errors`` says where).
        task: the task (``201``, ``200``; on a replay the original task), else ``None``.
        error: the RFC 9457 problem body the single endpoint would have answered, else ``None``.
        replayed: ``True`` exactly when ``status`` is ``200``.
    """

    model_config = ConfigDict(frozen=True)

    status: int
    task: Task | None = None
    error: Problem | None = None
    replayed: bool = False

    @property
    def ok(self) -> bool:
        """``True`` when the item names a task (``201`` created or ``200`` replayed)."""
        return self.status in (200, 201) and self.task is not None


class BatchSubmitResponse(BaseModel):
    """The ``200`` answer of ``POST /v1/namespaces/{ns}/tasks/batch``: one result per item, in order."""

    model_config = ConfigDict(frozen=True)

    items: list[BatchItemResult]


class CancelRequest(_Wire):
    """Body of ``POST .../tasks/{id}/cancel``: why (1-2000 characters, audited)."""

    reason: str = Field(min_length=1, max_length=2000)


class ReviewRequest(_Wire):
    """Body of ``POST .../tasks/{id}/review``: settle a ``NEEDS_REVIEW`` task.

    Attributes:
        outcome: ``"succeeded"`` or ``"failed"``: what the reviewer established.
        reason: why (audited).
        evidence_ref: where the evidence is, e.g. a ticket or a payment provider's
            reference (audited).
        result: the task's result when ``outcome`` is ``"succeeded"``.
        actor: the person deciding, recorded beside the API key; ``None`` records the key only.
    """

    outcome: Literal["succeeded", "failed"]
    reason: str = Field(min_length=1, max_length=2000)
    evidence_ref: str = Field(min_length=1, max_length=1000)
    result: JsonData = None
    actor: str | None = Field(default=None, min_length=1, max_length=255)

    @model_validator(mode="after")
    def _result_only_for_success(self) -> ReviewRequest:
        if self.outcome == "failed" and self.result is not None:
            raise ValueError("a result can only be given with outcome 'succeeded'")
        return self


class RetryRequest(_Wire):
    """Body of ``POST .../tasks/{id}/retry``: create the successor of a ``FAILED`` or ``CANCELLED`` task.

    Attributes:
        reason: why (audited on both tasks).
        deadline: the new task's deadline (UTC); ``None`` means none.
    """

    reason: str = Field(min_length=1, max_length=2000)
    deadline: UTCDateTime | None = None


class TaskEvent(_Wire):
    """One entry of a task's history (``GET .../tasks/{id}/events``), oldest first."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: int
    task_id: str
    state_version: int
    event: str
    from_status: TaskStatus | None = None
    to_status: TaskStatus | None = None
    actor: str | None = None
    reason: str | None = None
    data: JsonValue = None
    created_at: UTCDateTime


class TaskPage(_Wire):
    """A page of ``GET .../tasks``.

    Pass ``next_cursor`` back as ``cursor`` for the next page; ``None`` means this is the last one.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    items: list[Task]
    next_cursor: str | None = None
