"""Wire models of results: subscriptions, result events and their at-least-once deliveries.

README "Results and subscriptions".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    ConfigDict,
    Field,
    JsonValue,
    StrictInt,
)

from orbit_client._models import NAME_PATTERN, LeaseSeconds, UTCDateTime, _Wire
from orbit_client._task_models import TaskStatus

__all__ = [
    "Delivery",
    "DeliveryAck",
    "DeliveryLeaseRequest",
    "ResultEvent",
    "Subscription",
    "SubscriptionRequest",
]


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
