"""Optional OpenTelemetry tracing: W3C Trace Context carried with the work (README "Tracing").

A task's trace context (``traceparent``, ``tracestate``; W3C Trace Context Level 1) travels
with it: captured by ``enqueue``, stored in the outbox row, sent by the relay, stored with
the task, handed out with the lease, carried by the result event. Every process along the
way continues it in a span of its own.

``opentelemetry-api`` is optional (the ``otel`` extra). Without it :data:`AVAILABLE` is
``False`` and every helper here is a no-op that call sites skip with one module-level check,
so nothing is imported and nothing costs. With the API but no SDK (no tracer provider set),
spans are non-recording and carry their parent's context on unchanged.

Spans carry ids only (namespace, queue, handler, task id, attempt id, generation, outbox
row id, event id, subscription), never params, results, errors' text or idempotency keys.

Also used by ``outbox_adapter`` and ``orbit_server`` (one definition of the format).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from orbit_client._version import __version__

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanKind, Tracer

try:
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _otel_trace
except ImportError:  # pragma: no cover - exercised by the no-otel test in a subprocess
    _otel_trace = None  # type: ignore[assignment]
    _otel_context = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE",
    "TRACEPARENT_MAX_LENGTH",
    "TRACESTATE_MAX_LENGTH",
    "active",
    "clean",
    "current",
    "enabled",
    "end",
    "ids_of",
    "log_ids",
    "parse_traceparent",
    "set_attributes",
    "start_span",
    "traceparent_of",
    "use_span",
]

#: Whether ``opentelemetry-api`` is importable. ``False``: tracing costs nothing and does nothing.
AVAILABLE = _otel_trace is not None

#: A version-00 ``traceparent`` is exactly 55 characters.
TRACEPARENT_MAX_LENGTH = 55
#: W3C Trace Context: at most 32 list members, 512 characters is what a vendor must propagate.
TRACESTATE_MAX_LENGTH = 512

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_tracer: Tracer | None = None
_NOTHING: AbstractContextManager[None] = nullcontext()


def parse_traceparent(value: object) -> tuple[str, str, int] | None:
    """``(trace_id, span_id, flags)`` of a valid version-00 ``traceparent``, else ``None``.

    Lenient like the W3C rule for receivers: anything invalid (wrong shape, upper case,
    all-zero ids, another version) is ignored rather than refused.
    """
    if not isinstance(value, str) or len(value) != TRACEPARENT_MAX_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    trace_id, span_id, flags = match.groups()
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id, int(flags, 16)


def clean(traceparent: object, tracestate: object = None) -> tuple[str | None, str | None]:
    """The pair as stored: a valid ``traceparent`` (else ``None``, and no ``tracestate``) and a
    ``tracestate`` of at most :data:`TRACESTATE_MAX_LENGTH` printable ASCII characters (else ``None``)."""
    if parse_traceparent(traceparent) is None:
        return None, None
    state = (
        tracestate
        if isinstance(tracestate, str)
        and 0 < len(tracestate) <= TRACESTATE_MAX_LENGTH
        and tracestate.isascii()
        and tracestate.isprintable()
        else None
    )
    return traceparent, state  # type: ignore[return-value]


def ids_of(traceparent: str | None) -> dict[str, str]:
    """``{"trace_id": ..., "span_id": ...}`` of a ``traceparent`` (for log records), or ``{}``."""
    parsed = parse_traceparent(traceparent)
    return {"trace_id": parsed[0], "span_id": parsed[1]} if parsed else {}


def enabled() -> bool:
    """Whether this process set a tracer provider (an SDK is configured), so spans are recorded."""
    if _otel_trace is None:
        return False
    provider = _otel_trace.get_tracer_provider()
    return not isinstance(provider, _otel_trace.ProxyTracerProvider | _otel_trace.NoOpTracerProvider)


def _get_tracer() -> Tracer:
    global _tracer
    assert _otel_trace is not None
    if _tracer is None:
        # Before a provider is set this is a proxy tracer, which delegates to the provider set later.
        _tracer = _otel_trace.get_tracer("orbit", __version__)
    return _tracer


def traceparent_of(span: Span) -> tuple[str | None, str | None]:
    """The ``(traceparent, tracestate)`` headers naming ``span`` as the parent; ``(None, None)`` if invalid."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None, None
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state or None


def active() -> bool:
    """Whether a (valid) span is active in this context."""
    return _otel_trace is not None and _otel_trace.get_current_span().get_span_context().is_valid


def current() -> tuple[str | None, str | None]:
    """The ``(traceparent, tracestate)`` of the active span, or ``(None, None)`` when none is active
    (or ``opentelemetry-api`` is not installed)."""
    if _otel_trace is None:
        return None, None
    return traceparent_of(_otel_trace.get_current_span())


def _parent_context(traceparent: str | None, tracestate: str | None) -> Context | None:
    """A context whose (remote) parent span is the one ``traceparent`` names; ``None`` if it names none."""
    parsed = parse_traceparent(traceparent)
    if parsed is None or _otel_trace is None:
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    try:
        state = TraceState.from_header([tracestate]) if tracestate else TraceState()
    except Exception:  # a malformed tracestate is dropped, never fatal
        state = TraceState()
    ctx = SpanContext(
        trace_id=int(parsed[0], 16),
        span_id=int(parsed[1], 16),
        is_remote=True,
        trace_flags=TraceFlags(parsed[2]),
        trace_state=state,
    )
    return _otel_trace.set_span_in_context(NonRecordingSpan(ctx))


def _kind(kind: str) -> SpanKind:
    assert _otel_trace is not None
    return getattr(_otel_trace.SpanKind, kind.upper())  # type: ignore[no-any-return]


def start_span(
    name: str,
    *,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
    traceparent: str | None = None,
    tracestate: str | None = None,
    root: bool = False,
    links: Sequence[tuple[str | None, str | None]] = (),
    start_time: int | None = None,
) -> Span | None:
    """Start (not activate) a span; ``None`` when ``opentelemetry-api`` is not installed.

    Args:
        name: the span's name, e.g. ``"orbit.relay.send"``.
        attributes: ids only (never params, results or keys); ``None`` values are left out.
        kind: ``"internal"``, ``"server"``, ``"client"``, ``"producer"`` or ``"consumer"``.
        traceparent, tracestate: the parent (a remote span); ``None`` means the active span,
            or a new trace with ``root``.
        root: start a new trace even if a span is active (ignored when ``traceparent`` is given).
        links: ``(traceparent, tracestate)`` pairs the span is linked to (invalid ones skipped).
        start_time: the start in nanoseconds since the epoch (``time.time_ns()``); ``None``: now.
    """
    if _otel_trace is None:
        return None
    context = _parent_context(traceparent, tracestate)
    if context is None and root:
        assert _otel_context is not None
        context = _otel_context.Context()
    span_links = []
    for link_parent, link_state in links:
        parent = _parent_context(link_parent, link_state)
        if parent is not None:
            span_links.append(_otel_trace.Link(_otel_trace.get_current_span(parent).get_span_context()))
    return _get_tracer().start_span(
        name,
        context=context,
        kind=_kind(kind),
        attributes={k: v for k, v in attributes.items() if v is not None} if attributes else None,
        links=span_links or None,
        start_time=start_time,
    )


def use_span(span: Span | None) -> AbstractContextManager[Any]:
    """Make ``span`` the active span in the block and end it after (records an escaping exception
    and marks the span as an error). ``None``: a context manager that does nothing."""
    if span is None or _otel_trace is None:
        return _NOTHING
    return _otel_trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True)


def log_ids() -> dict[str, str]:
    """``{"trace_id", "span_id"}`` of the active span (32 and 16 hex digits) for a log line, or ``{}``."""
    if _otel_trace is None:
        return {}
    ctx = _otel_trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    """Set the non-``None`` ``attributes`` on ``span`` (``None``: nothing)."""
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def end(span: Span | None, *, error: str | None = None) -> None:
    """End ``span``; with ``error`` (a short, param-free description) its status is ERROR."""
    if span is None:
        return
    if error is not None and _otel_trace is not None:
        span.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR, error))
    span.end()


# --- worker -------------------------------------------------------------------------------------------


def run_span(grant: Any, worker_id: str) -> Span | None:
    """The span a worker runs a leased task in (``orbit.task.run``, kind consumer), continuing the
    task's ``traceparent``; ``None`` when the task has none and no tracer provider is set."""
    task, attempt = grant.task, grant.attempt
    if task.traceparent is None and not enabled():
        return None
    return start_span(
        "orbit.task.run",
        kind="consumer",
        traceparent=task.traceparent,
        tracestate=task.tracestate,
        root=True,
        attributes={
            "orbit.namespace": task.namespace,
            "orbit.queue": task.queue,
            "orbit.handler": task.handler,
            "orbit.task.id": task.id,
            "orbit.attempt.id": attempt.id,
            "orbit.attempt.generation": attempt.generation,
            "orbit.worker.id": worker_id,
        },
    )


def handler_failed(exc: BaseException, error_type: str) -> None:
    """Mark the active span (a task's run) as failed by ``exc`` (type and traceback; never params)."""
    if _otel_trace is None:
        return
    span = _otel_trace.get_current_span()
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(_otel_trace.Status(_otel_trace.StatusCode.ERROR, error_type))


def report_span(what: str, attempt: Any) -> Span | None:
    """``orbit.attempt.complete`` / ``orbit.attempt.fail`` (kind client) under the active span; ``None``
    outside one (the task is not traced)."""
    if _otel_trace is None or not _otel_trace.get_current_span().get_span_context().is_valid:
        return None
    return start_span(
        f"orbit.attempt.{what}",
        kind="client",
        attributes={"orbit.attempt.id": attempt.id, "orbit.attempt.generation": attempt.generation},
    )
