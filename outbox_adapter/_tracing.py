"""Spans of the outbox side of a task's trace (README "Tracing"): enqueue, relay send, inbox apply.

Thin hooks over :mod:`orbit_client._tracing`; call sites check ``_tracing.AVAILABLE`` (a module
constant) first, so without ``opentelemetry-api`` nothing here runs. ``enqueue`` traces only
inside an active span (the business transaction's); a row enqueued outside one carries no
trace context and costs nothing more.

Attributes are ids only (``orbit.namespace``, ``orbit.queue``, ``orbit.handler``,
``orbit.outbox.row_id``, ``orbit.task.id``, ...): never params, results or idempotency keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orbit_client import Delivery
from orbit_client import _tracing as t
from outbox_adapter import _queries as q

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from outbox_adapter._outcomes import SendOutcome

__all__ = [
    "SendTrace",
    "applied",
    "apply_span",
    "enqueue_span",
    "enqueued",
    "finish_send",
    "log_ids",
    "start_send",
]


def enqueue_span(values: dict[str, Any]) -> Span | None:
    """Start ``orbit.outbox.enqueue`` (kind producer) under the active span and put its trace context
    in ``values`` (the row's ``traceparent``/``tracestate``); ``None`` when no span is active."""
    if not t.active():
        return None
    span = t.start_span(
        "orbit.outbox.enqueue",
        kind="producer",
        attributes={
            "orbit.namespace": values["namespace"],
            **(
                {"orbit.flow": values["flow"]}
                if values.get("flow")
                else {"orbit.queue": values["queue"], "orbit.handler": values["handler"]}
            ),
        },
    )
    if span is not None:
        values["traceparent"], values["tracestate"] = t.clean(*t.traceparent_of(span))
    return span


def enqueued(span: Span, row_id: int | None, error: BaseException | None = None) -> None:
    """End the enqueue span with the row's id (or the error that kept it from being written)."""
    if error is not None:
        span.record_exception(error)
        t.end(span, error=type(error).__name__)
        return
    t.set_attributes(span, {"orbit.outbox.row_id": row_id})
    span.end()


@dataclass
class SendTrace:
    """The relay's spans of one request: ``orbit.relay.send`` per traced row (in that row's trace) and,
    when spans are recorded, one ``orbit.relay.send_batch`` linked to the rows' traces."""

    spans: dict[int, Span] = field(default_factory=dict)  # by row id
    batch: Span | None = None

    def headers(self, claim: q.Claim) -> tuple[str | None, str | None]:
        """What to send as the row's trace context: its send span's (else what the row stored)."""
        span = self.spans.get(claim.id)
        if span is None:
            return claim.traceparent, claim.tracestate
        traceparent, tracestate = t.traceparent_of(span)
        return (traceparent, tracestate) if traceparent else (claim.traceparent, claim.tracestate)


def start_send(namespace: str, claims: Sequence[q.Claim]) -> SendTrace | None:
    """The spans of a request sending ``claims``; ``None`` when no row carries a trace context."""
    traced = [claim for claim in claims if claim.traceparent is not None]
    if not traced:
        return None
    trace = SendTrace()
    if t.enabled():
        trace.batch = t.start_span(
            "orbit.relay.send_batch",
            kind="client",
            root=True,
            links=[(c.traceparent, c.tracestate) for c in traced],
            attributes={"orbit.namespace": namespace, "orbit.batch.size": len(claims)},
        )
    batch_link = [t.traceparent_of(trace.batch)] if trace.batch is not None else []
    for claim in traced:
        span = t.start_span(
            "orbit.relay.send",
            kind="producer",
            traceparent=claim.traceparent,
            tracestate=claim.tracestate,
            links=batch_link,
            attributes={
                "orbit.namespace": claim.namespace,
                **(
                    {"orbit.flow": claim.flow or ""}
                    if claim.is_flow
                    else {"orbit.queue": claim.queue, "orbit.handler": claim.handler}
                ),
                "orbit.outbox.row_id": claim.id,
                "orbit.outbox.attempt": claim.attempts,
                "orbit.batch.size": len(claims),
            },
        )
        if span is not None:
            trace.spans[claim.id] = span
    return trace


def finish_send(
    trace: SendTrace, claims: Sequence[q.Claim], outcomes: Sequence[SendOutcome | None] | BaseException
) -> None:
    """End the spans with each row's outcome (task id, status code, verdict) or the exception."""
    for index, claim in enumerate(claims):
        span = trace.spans.get(claim.id)
        if span is None:
            continue
        if isinstance(outcomes, BaseException):
            span.record_exception(outcomes)
            t.end(span, error=type(outcomes).__name__)
            continue
        outcome = outcomes[index]
        if outcome is None:
            t.set_attributes(span, {"orbit.outbox.verdict": "released"})
            span.end()
            continue
        t.set_attributes(
            span,
            {
                "orbit.task.id": outcome.task_id,
                "orbit.outbox.verdict": outcome.verdict.value,
                "http.response.status_code": outcome.status_code,
            },
        )
        t.end(span, error=None if outcome.task_id else outcome.verdict.value)
    if trace.batch is not None:
        trace.batch.end()


def apply_span(delivery: Delivery, subscription: str) -> Span | None:
    """``orbit.inbox.apply`` (kind consumer) continuing the result event's trace; ``None`` when the
    event has no trace context and no tracer provider is set."""
    event = delivery.event
    if event.traceparent is None and not t.enabled():
        return None
    return t.start_span(
        "orbit.inbox.apply",
        kind="consumer",
        traceparent=event.traceparent,
        tracestate=event.tracestate,
        root=True,
        attributes={
            "orbit.namespace": event.namespace,
            "orbit.queue": event.queue,
            "orbit.handler": event.handler,
            "orbit.task.id": event.task_id,
            "orbit.event.id": event.id,
            "orbit.delivery.id": delivery.id,
            "orbit.delivery.count": delivery.delivery_count,
            "orbit.subscription": subscription,
            "orbit.task.status": event.status.value,
        },
    )


def applied(span: Span | None, kind: str) -> None:
    """Record what became of the delivery (``applied``, ``duplicate``, ``failed``, ``parked``); the last
    two mark the span as an error (the handler failed)."""
    if span is None:
        return
    span.set_attribute("orbit.inbox.outcome", kind)
    if kind in ("failed", "parked") and t.AVAILABLE:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"handler {kind}"))


def log_ids(claim: q.Claim) -> Mapping[str, str]:
    """``trace_id``/``span_id`` of a row's stored trace context for its log lines, or ``{}``."""
    return t.ids_of(claim.traceparent) if claim.traceparent else {}
