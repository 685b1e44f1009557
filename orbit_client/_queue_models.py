"""Wire models of queues (``/v1/namespaces/{ns}/queues/{queue}``): the queue, its control and limits.

A queue may limit how many attempts are live (``LEASED``/``RUNNING``) at once, per task
``concurrency_key`` and in all, and may be paused: a paused queue grants no new leases and no
starts, while attempts in flight still heartbeat, complete and fail (README "Concurrency
limits and pausing a queue").
"""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, StrictInt, model_validator

from ._models import UTCDateTime, _Wire
from ._task_models import TaskStatus

__all__ = ["MAX_CONCURRENCY_LIMIT", "Queue", "QueueControl", "QueueUpdate"]

#: The largest value either limit may have.
MAX_CONCURRENCY_LIMIT = 1_000_000


class QueueUpdate(_Wire):
    """Body of ``PATCH /v1/namespaces/{ns}/queues/{queue}``: change a queue's limits.

    Only the fields given change; ``null`` removes that limit.

    Attributes:
        max_concurrency_per_key: live attempts allowed per task ``concurrency_key``
            (1-1,000,000); tasks without a key are not limited by it.
        max_concurrency: live attempts allowed in the whole queue (1-1,000,000).
        reason: why (audited with the change), up to 2000 characters.
        actor: the person acting, recorded beside the API key.
    """

    max_concurrency_per_key: StrictInt | None = Field(default=None, ge=1, le=MAX_CONCURRENCY_LIMIT)
    max_concurrency: StrictInt | None = Field(default=None, ge=1, le=MAX_CONCURRENCY_LIMIT)
    reason: str | None = Field(default=None, min_length=1, max_length=2000)
    actor: str | None = Field(default=None, min_length=1, max_length=255)

    @model_validator(mode="after")
    def _some_limit(self) -> Self:
        if not self.model_fields_set & {"max_concurrency_per_key", "max_concurrency"}:
            raise ValueError("give max_concurrency_per_key and/or max_concurrency (null removes a limit)")
        return self


class QueueControl(_Wire):
    """Body of ``POST .../queues/{queue}/pause`` and ``.../resume`` (may be empty): audit fields.

    Attributes:
        reason: why (audited), up to 2000 characters.
        actor: the person acting, recorded beside the API key.
    """

    reason: str | None = Field(default=None, min_length=1, max_length=2000)
    actor: str | None = Field(default=None, min_length=1, max_length=255)


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
