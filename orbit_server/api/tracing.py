"""Server spans of a task's trace (README "Tracing"): accept, lease and result delivery hooks.

Thin wrappers over :mod:`orbit_client._tracing` (one definition of the W3C format). A task's
trace context is what its submission carried (the ``traceparent``/``tracestate`` headers, or
the batch item's fields), stored with the task as given (a malformed one is ignored, as
W3C Trace Context asks of receivers). Without ``opentelemetry-api``, or without a tracer
provider and a trace context, nothing here creates anything.

Attributes are ids only: ``orbit.namespace``, ``orbit.queue``, ``orbit.handler``,
``orbit.task.id``, ``orbit.attempt.id``, ``orbit.attempt.generation``; never params, results or keys.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orbit_client import LeaseGrant, Task
from orbit_client import _tracing as t

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["accept_span", "accepted", "batch_accepted", "lease_granted"]


def accept_span(
    namespace: str, queue: str, handler: str, traceparent: str | None, tracestate: str | None
) -> Span | None:
    """The span of one submission (``orbit.accept``, kind server) continuing ``traceparent``; ``None``
    when there is nothing to trace (no ``opentelemetry-api``, or neither a trace context nor a provider)."""
    if not t.AVAILABLE or (traceparent is None and not t.enabled()):
        return None
    return t.start_span(
        "orbit.accept",
        kind="server",
        traceparent=traceparent,
        tracestate=tracestate,
        attributes={"orbit.namespace": namespace, "orbit.queue": queue, "orbit.handler": handler},
    )


def accepted(span: Span | None, task: Task, replayed: bool) -> None:
    """Record on ``span`` which task the submission named."""
    t.set_attributes(span, {"orbit.task.id": task.id, "orbit.replayed": replayed})


def batch_accepted(
    started_ns: int, traced: Sequence[tuple[Task | None, int, str | None, str | None]]
) -> None:
    """One ``orbit.accept`` span per traced batch item, from the request's start to now.

    ``traced``: ``(task or None when refused, status, traceparent, tracestate)`` per item that carried one.
    """
    if not t.AVAILABLE:
        return
    for task, status, traceparent, tracestate in traced:
        span = t.start_span(
            "orbit.accept",
            kind="server",
            traceparent=traceparent,
            tracestate=tracestate,
            start_time=started_ns,
            attributes={
                "orbit.namespace": task.namespace if task else None,
                "orbit.queue": task.queue if task else None,
                "orbit.handler": task.handler if task else None,
                "orbit.task.id": task.id if task else None,
                "orbit.batch": True,
                "orbit.replayed": status == 200,
                "http.response.status_code": status,
            },
        )
        t.end(span, error=None if task is not None else f"item refused with status {status}")


def lease_granted(started_ns: int, grants: Sequence[LeaseGrant], worker_id: str) -> None:
    """One ``orbit.lease`` span per granted task that has a trace context, from the request's start
    to now (only when this process records spans: a tracer provider is set)."""
    if not t.AVAILABLE or not grants or not t.enabled():
        return
    now = time.time_ns()
    for grant in grants:
        task = grant.task
        if task.traceparent is None:
            continue
        span = t.start_span(
            "orbit.lease",
            kind="server",
            traceparent=task.traceparent,
            tracestate=task.tracestate,
            start_time=started_ns,
            attributes={
                "orbit.namespace": task.namespace,
                "orbit.queue": task.queue,
                "orbit.handler": task.handler,
                "orbit.task.id": task.id,
                "orbit.attempt.id": grant.attempt.id,
                "orbit.attempt.generation": grant.attempt.generation,
                "orbit.worker.id": worker_id,
            },
        )
        if span is not None:
            span.end(end_time=now)
