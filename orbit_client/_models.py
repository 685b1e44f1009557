"""Wire models: every request, response and error body that crosses HTTP.

These definitions are the single source of truth for the wire format. The server
(`orbit_server`) validates and serialises with the same classes, so the client,
the server and the OpenAPI document cannot drift apart (DESIGN §1).

Times on the wire are RFC 3339 strings in UTC with a ``Z`` suffix; in Python they
are timezone-aware :class:`datetime.datetime` objects in UTC.
"""

from __future__ import annotations

import enum
import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
    model_validator,
)

__all__ = [
    "IDEMPOTENCY_KEY_MAX_LENGTH",
    "JSON_MAX_DEPTH",
    "JSON_MAX_INTEGER_DIGITS",
    "MAX_ATTEMPT_BATCH_ITEMS",
    "NAME_PATTERN",
    "TRACEBACK_MAX_LENGTH",
    "Attempt",
    "AttemptBatchResponse",
    "AttemptError",
    "AttemptItemResult",
    "AttemptLease",
    "AttemptState",
    "AttemptStatus",
    "BatchItem",
    "BatchItemResult",
    "BatchSubmission",
    "BatchSubmitResponse",
    "CancelRequest",
    "CompleteBatch",
    "CompleteItem",
    "CompleteRequest",
    "Delivery",
    "DeliveryAck",
    "DeliveryLeaseRequest",
    "FailBatch",
    "FailItem",
    "FailRequest",
    "HeartbeatBatch",
    "HeartbeatItem",
    "HeartbeatRequest",
    "JsonData",
    "LeaseGrant",
    "LeaseRequest",
    "LeaseTokenRequest",
    "Problem",
    "Queue",
    "ResultEvent",
    "RetryRequest",
    "ReviewRequest",
    "StartBatch",
    "StartItem",
    "SubmitOptions",
    "SubmitResult",
    "Subscription",
    "SubscriptionRequest",
    "Task",
    "TaskEvent",
    "TaskPage",
    "TaskStatus",
    "TaskSubmission",
    "UTCDateTime",
    "canonical_json",
    "check_json_data",
    "is_valid_idempotency_key",
]

#: Longest idempotency key accepted, in characters (IETF Idempotency-Key draft leaves it to the server).
IDEMPOTENCY_KEY_MAX_LENGTH = 255
_IDEMPOTENCY_KEY_RE = re.compile(r"[\x20-\x7e]{1,255}")

#: Namespace and queue names: a letter or digit, then up to 63 letters, digits, ``.``, ``_`` or ``-``.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def is_valid_idempotency_key(key: str) -> bool:
    """Tell whether ``key`` is a well-formed idempotency key.

    A key is 1 to 255 printable ASCII characters (0x20-0x7E) with no leading or
    trailing space (HTTP strips those from header values, so they could not be
    told apart on the server).
    """
    return bool(_IDEMPOTENCY_KEY_RE.fullmatch(key)) and key == key.strip()


def _to_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("datetime must carry a timezone offset (e.g. 2026-01-01T00:00:00Z)")
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("datetime is out of range once converted to UTC") from None


#: Deepest nesting of arrays and objects accepted in JSON data (MySQL/MariaDB refuse deeper documents).
JSON_MAX_DEPTH = 30
#: Most digits of an integer in JSON data: Python's limit for converting integers to and from text
#: (``sys.get_int_max_str_digits()`` default), so every server process can read and write it back.
JSON_MAX_INTEGER_DIGITS = 4300
_INTEGER_LIMIT = 10**JSON_MAX_INTEGER_DIGITS
_INTEGER_LIMIT_BITS = _INTEGER_LIMIT.bit_length() - 1


def check_json_data(value: Any) -> Any:
    """Return ``value`` if it is JSON data that Orbit stores and returns unchanged; else raise ValueError.

    The rules, the same on the client, the outbox (``enqueue``) and the server, on every database:
    strings are valid Unicode (a lone surrogate is not UTF-8, RFC 8259 §8.1); numbers are finite
    (NaN and infinities, also ``1e400``, which parses as infinity, are not JSON numbers, RFC 8259 §6);
    integers have at most :data:`JSON_MAX_INTEGER_DIGITS` digits; arrays and objects nest at most
    :data:`JSON_MAX_DEPTH` levels (MySQL/MariaDB's JSON type refuses deeper documents). The
    message names the rule and its limit.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_utf8(item)
        elif isinstance(item, dict | list):
            if depth >= JSON_MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {JSON_MAX_DEPTH} levels (the limit)")
            if isinstance(item, dict):
                for key in item:
                    _check_utf8(key)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError("NaN and infinite numbers are not JSON")
        elif (
            isinstance(item, int) and item.bit_length() >= _INTEGER_LIMIT_BITS and abs(item) >= _INTEGER_LIMIT
        ):
            raise ValueError(f"an integer has more than {JSON_MAX_INTEGER_DIGITS} digits (the limit)")
    return value


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (a lone surrogate such as \\ud800 is not)") from None


#: Any JSON value that survives storage unchanged: finite numbers, valid Unicode, bounded depth.
JsonData = Annotated[JsonValue, AfterValidator(check_json_data)]


def canonical_json(value: Any) -> Any:
    """``value`` with integral floats written as integers, as RFC 8785 (JCS) serialises numbers.

    So ``1`` and ``1.0`` mean the same in a request digest.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: canonical_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical_json(v) for v in value]
    return value


def _format_utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


#: RFC 3339 date-time (``2026-01-01T00:00:00Z``, ``...T00:00:00.5+02:00``); an offset is checked later.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,6})?([Zz]|[+-]\d{2}:\d{2})?")


def _time_text(value: Any) -> Any:
    """Let only RFC 3339 strings (and datetimes) through: never a number, which pydantic would take
    as seconds since 1970 (``deadline: 0.0`` was 1970-01-01), nor a date alone."""
    if isinstance(value, datetime) or (isinstance(value, str) and _RFC3339.fullmatch(value)):
        return value
    raise ValueError("a time is an RFC 3339 string with an offset, e.g. 2026-01-01T00:00:00Z")


#: A timezone-aware datetime, normalised to UTC, serialised as RFC 3339 with ``Z``. On input only an
#: RFC 3339 string (JSON) or a datetime (Python) is accepted, as the OpenAPI document says.
UTCDateTime = Annotated[
    datetime,
    BeforeValidator(_time_text),
    AfterValidator(_to_utc),
    PlainSerializer(_format_utc, return_type=str, when_used="json"),
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


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    """

    max_attempts: StrictInt | None = Field(default=None, ge=1, le=1000)
    available_at: UTCDateTime | None = None
    deadline: UTCDateTime | None = None
    retry_safe: StrictBool | None = None
    backoff_base_seconds: StrictFloat | None = Field(default=None, ge=0, le=86400)
    backoff_cap_seconds: StrictFloat | None = Field(default=None, ge=0, le=7 * 86400)
    concurrency_key: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")


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
        what ``None`` means. Integral numbers are written as integers (RFC 8785), so
        ``1`` and ``1.0`` digest alike.
        """
        options = self.options.model_dump(mode="json", exclude_none=True) if self.options else {}
        if options.get("retry_safe") is False:
            del options["retry_safe"]
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
    #: The W3C ``traceparent`` the submission carried (README "Tracing"); ``None`` when none was given.
    traceparent: str | None = None
    #: The W3C ``tracestate`` that came with ``traceparent``; ``None`` when none was given.
    tracestate: str | None = None


class Queue(_Wire):
    """A queue and how many of its tasks are in each state."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    namespace: str
    name: str
    created_at: UTCDateTime
    counts: dict[TaskStatus, int] = Field(default_factory=dict)
    #: A paused queue grants no new leases and no starts; attempts in flight still report.
    paused: bool = False
    #: Live (``LEASED``/``RUNNING``) attempts allowed per ``concurrency_key``; ``None``: no limit.
    max_concurrency_per_key: int | None = None
    #: Live attempts allowed in the whole queue; ``None``: no limit.
    max_concurrency: int | None = None
    #: Bumped by every pause, resume and change of limits.
    control_version: int = 1


class Problem(BaseModel):
    """An error body: RFC 9457 problem details with Orbit's ``code`` extension member.

    ``code`` is stable and machine-readable (e.g. ``idempotency_key_reused``);
    ``detail`` is for humans and may change.
    """

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    code: str
    request_id: str | None = None


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


#: A lease duration in seconds: at least 0.1 s, at most one hour.
LeaseSeconds = Annotated[StrictFloat, Field(ge=0.1, le=3600)]


class LeaseRequest(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/queues/{queue}/leases``.

    Attributes:
        worker_id: names the worker process, for operators (1-255 characters); not a secret.
        max_tasks: most tasks granted by this call, 1-100.
        lease_seconds: how long each grant stays valid without a heartbeat, in seconds,
            judged by the database clock. Default 30.
        wait_seconds: long-poll: when nothing is due, wait up to this many seconds for a
            task before answering with an empty list; 0 (the default) answers at once.
    """

    worker_id: str = Field(min_length=1, max_length=255)
    max_tasks: StrictInt = Field(default=1, ge=1, le=100)
    lease_seconds: LeaseSeconds = 30.0
    wait_seconds: StrictFloat = Field(default=0.0, ge=0, le=60)


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


class StartItem(LeaseTokenRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/start``: which attempt, and its token."""

    attempt_id: AttemptId


class HeartbeatItem(HeartbeatRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/heartbeat`` (fields of :class:`HeartbeatRequest`)."""

    attempt_id: AttemptId


class CompleteItem(CompleteRequest):
    """One item of ``POST /v1/namespaces/{ns}/attempts/complete`` (fields of :class:`CompleteRequest`)."""

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
    """Body of ``POST /v1/namespaces/{ns}/attempts/complete``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS` items."""

    items: list[CompleteItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)


class FailBatch(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/attempts/fail``: 1 to :data:`MAX_ATTEMPT_BATCH_ITEMS` items."""

    items: list[FailItem] = Field(min_length=1, max_length=MAX_ATTEMPT_BATCH_ITEMS)


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
        from orbit_client._exceptions import _api_error_class

        problem = self.error
        code = problem.code if problem is not None else f"http_{self.status}"
        error_class = _api_error_class(self.status, code)
        detail = problem.detail if problem is not None else None
        title = problem.title if problem is not None else None
        request_id = problem.request_id if problem is not None else None
        message = f"batch item failed with {self.status} {code}"
        if detail or title:
            message += f": {detail or title}"
        if request_id:
            message += f" (request id {request_id})"
        raise error_class(
            f"{message}; {error_class.hint}",
            status_code=self.status,
            code=code,
            title=title,
            detail=detail,
            request_id=request_id,
            problem=problem,
        )


class AttemptBatchResponse(BaseModel):
    """The answer (200) to a batched attempt call: one :class:`AttemptItemResult` per item, in order."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    items: list[AttemptItemResult]


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


# --------------------------------------------------------------------------------------------------
# Result events: subscriptions and deliveries (DESIGN §4 "Result events", §6.2 of the reliability model)


class SubscriptionRequest(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/subscriptions`` (admin role).

    Attributes:
        name: the subscription's name, unique in the namespace (the pattern of queue names).
        queues: the queues whose result events it receives (1-100 names, order and repeats
            ignored); ``None`` means every queue of the namespace, including later ones.
    """

    name: str = Field(pattern=NAME_PATTERN)
    queues: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(
        default=None, min_length=1, max_length=100
    )


class Subscription(_Wire):
    """A named, durable stream of a namespace's result events.

    Attributes:
        namespace: the namespace it belongs to.
        name: its name, unique in the namespace.
        queues: the queue names it is filtered on (sorted); ``None`` means every queue.
        created_at: when it was created (UTC, database clock). It receives exactly the
            result events that occurred at or after this time, never earlier ones.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    namespace: str
    name: str
    queues: list[str] | None = None
    created_at: UTCDateTime


class ResultEvent(_Wire):
    """A task reached ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW``.

    Written in the same transaction as that transition, so it exists exactly when the
    transition committed. A task that goes ``NEEDS_REVIEW`` and is then reviewed has two
    events. Receivers dedupe by ``id`` (README "Consuming results (inbox)").

    Attributes:
        id: the event's id (a UUID), the same in every delivery of the event.
        task_id, namespace, queue, handler: which task.
        status: the state the task reached.
        result: the task's result (``SUCCEEDED``), else usually ``None``.
        error: the task's error (``FAILED``, ``NEEDS_REVIEW``, sometimes ``CANCELLED``), else ``None``.
        occurred_at: when the transition happened (UTC, database clock).
        idempotency_key: the ``Idempotency-Key`` of the submission that created the task
            (what an outbox row knows its task by). For a task created by manual retry, the key
            of its retry chain's first task, so the event still finds its business record;
            ``None`` when that key has expired (the server keeps keys for its key window).
        retry_of: for a task created by manual retry, the task it retries (its predecessor);
            ``None`` otherwise. The first task's events and its successor's carry the same
            ``idempotency_key``: a receiver tells them apart by ``task_id`` and ``retry_of``.
        traceparent, tracestate: the task's W3C Trace Context (README "Tracing"), so the
            consumer continues the trace; ``None`` when the task has none.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    task_id: str
    namespace: str
    queue: str
    handler: str
    status: TaskStatus
    result: JsonValue = None
    error: JsonValue = None
    occurred_at: UTCDateTime
    idempotency_key: str | None = None
    retry_of: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None


class DeliveryLeaseRequest(_Wire):
    """Body of ``POST .../subscriptions/{name}/deliveries/lease`` (work or admin role).

    Attributes:
        max: most deliveries handed out by this call, 1-500. Default 10.
        lease_seconds: how long they stay leased, in seconds (0.1-3600, database clock);
            a delivery not acked by then is handed out again. Default 30.
    """

    max: StrictInt = Field(default=10, ge=1, le=500)
    lease_seconds: LeaseSeconds = 30.0


class Delivery(_Wire):
    """One result event handed to one subscription's consumer, until acked.

    Attributes:
        id: the delivery's id; ack it with ``POST .../deliveries/{id}/ack``.
        subscription: the subscription's name.
        delivery_count: how many times it has been leased, this lease included (1 the first
            time; more means an earlier lease lapsed without an ack).
        lease_expires_at: when this lease lapses (UTC, database clock); after that, an
            unacked delivery is handed out again.
        event: the result event.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    subscription: str
    delivery_count: int
    lease_expires_at: UTCDateTime
    event: ResultEvent


class DeliveryAck(_Wire):
    """The answer to ``POST .../deliveries/{id}/ack``: when the delivery was (first) acked (UTC)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    subscription: str
    acked_at: UTCDateTime
