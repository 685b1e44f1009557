"""Wire models: every request, response and error body that crosses HTTP.

These definitions are the single source of truth for the wire format. The server
(`orbit_server`) validates and serialises with the same classes, so the client,
the server and the OpenAPI document cannot drift apart (DESIGN §1).

Times on the wire are RFC 3339 strings in UTC with a ``Z`` suffix; in Python they
are timezone-aware :class:`datetime.datetime` objects in UTC.
"""

from __future__ import annotations

import enum
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
)

__all__ = [
    "IDEMPOTENCY_KEY_MAX_LENGTH",
    "NAME_PATTERN",
    "Problem",
    "Queue",
    "SubmitOptions",
    "SubmitResult",
    "Task",
    "TaskStatus",
    "TaskSubmission",
    "UTCDateTime",
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
    return value.astimezone(UTC)


def _format_utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


#: A timezone-aware datetime, normalised to UTC, serialised as RFC 3339 with ``Z``.
UTCDateTime = Annotated[
    datetime,
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
    """

    max_attempts: int | None = Field(default=None, ge=1, le=1000)
    available_at: UTCDateTime | None = None
    deadline: UTCDateTime | None = None
    retry_safe: bool | None = None


class TaskSubmission(_Wire):
    """Body of ``POST /v1/namespaces/{ns}/tasks``.

    ``params`` is any JSON value; it is stored and returned unchanged.
    """

    queue: str = Field(pattern=NAME_PATTERN)
    handler: str = Field(min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$")
    params: JsonValue = None
    options: SubmitOptions | None = None

    def canonical_meaning(self) -> dict[str, Any]:
        """What the submission means, as plain JSON data, for the request digest.

        Options left at ``None`` are dropped, so ``{}`` and a missing ``options``
        mean the same thing and digest the same.
        """
        options = self.options.model_dump(mode="json", exclude_none=True) if self.options else {}
        return {
            "queue": self.queue,
            "handler": self.handler,
            "params": self.params,
            "options": options,
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


class Queue(_Wire):
    """A queue and how many of its tasks are in each state."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    namespace: str
    name: str
    created_at: UTCDateTime
    counts: dict[TaskStatus, int] = Field(default_factory=dict)


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
