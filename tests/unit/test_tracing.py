"""Trace context helpers, enqueue's capture, the client's header and JSON log lines (README "Tracing").

Spans are recorded by a local SDK ``TracerProvider`` (never the global one, which other tests share).
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import respx
import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orbit_client import JsonFormatter, OrbitClient, _tracing
from outbox_adapter import Outbox, OutboxTables, enqueue

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def tracer() -> Iterator[object]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    yield provider.get_tracer("test")
    provider.shutdown()


def test_traceparent_parsing_is_lenient_like_w3c_receivers() -> None:
    assert _tracing.parse_traceparent(TP) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    for bad in (
        None,
        7,
        "",
        TP.upper(),
        TP[:-1],
        "01" + TP[2:],
        "00-" + "0" * 32 + TP[35:],
        TP[:36] + "0" * 16 + "-01",
    ):
        assert _tracing.parse_traceparent(bad) is None, bad
    assert _tracing.clean(TP, "a=1") == (TP, "a=1")
    assert _tracing.clean(TP, "x" * 513) == (TP, None)
    assert _tracing.clean("junk", "a=1") == (None, None)
    assert _tracing.ids_of(TP) == {
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "span_id": "00f067aa0ba902b7",
    }


def _outbox(tmp_path: Path) -> tuple[sa.Engine, OutboxTables]:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'biz.db'}")
    outbox = Outbox(engine)
    outbox.migrate()
    return engine, outbox.tables


def test_enqueue_stores_the_active_trace_context_and_none_outside_a_span(
    tmp_path: Path, tracer: object
) -> None:
    engine, tables = _outbox(tmp_path)
    with engine.begin() as conn:
        plain = enqueue(conn, namespace="shop", queue="q", handler="h", params={})
        with tracer.start_as_current_span("business") as span:  # type: ignore[attr-defined]
            traced = enqueue(conn, namespace="shop", queue="q", handler="h", params={"secret": 1})
            expected = _tracing.traceparent_of(span)
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(tables.outbox.c.id, tables.outbox.c.traceparent)).all())
    assert rows[plain.id] is None
    # No global provider here: enqueue's own span is non-recording and passes the parent on.
    assert rows[traced.id] == expected[0]
    assert expected[0] is not None and _tracing.parse_traceparent(expected[0]) is not None


@respx.mock
def test_the_client_sends_the_active_span_as_the_traceparent_header(tracer: object) -> None:
    route = respx.post("http://orbit.test/v1/namespaces/ns/tasks").mock(
        return_value=httpx.Response(400, json={"title": "x", "status": 400, "code": "x"})
    )
    with OrbitClient("http://orbit.test", api_key="k") as client:
        with tracer.start_as_current_span("caller") as span:  # type: ignore[attr-defined]
            with pytest.raises(Exception):  # noqa: B017 - only the request matters here
                client.submit_task("ns", "q", "h", {}, idempotency_key="k1")
            with pytest.raises(Exception):  # noqa: B017
                client.submit_task("ns", "q", "h", {}, idempotency_key="k2", traceparent=TP, tracestate="a=1")
        with pytest.raises(Exception):  # noqa: B017
            client.submit_task("ns", "q", "h", {}, idempotency_key="k3")
    sent = [call.request.headers for call in route.calls]
    assert sent[0]["traceparent"] == _tracing.traceparent_of(span)[0]
    assert sent[1]["traceparent"] == TP and sent[1]["tracestate"] == "a=1"
    assert "traceparent" not in sent[2]


def test_json_log_lines_carry_the_trace_and_span_ids(tracer: object) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tests.tracing")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("outside", extra={"task_id": "t1"})
        with tracer.start_as_current_span("inside") as span:  # type: ignore[attr-defined]
            log.warning("inside", extra={"task_id": "t2"})
        log.warning("row", extra={"row_id": 3, **_tracing.ids_of(TP)})
    finally:
        log.removeHandler(handler)
    outside, inside, row = (json.loads(line) for line in out.getvalue().splitlines())
    assert "trace_id" not in outside and outside["task_id"] == "t1"
    ctx = span.get_span_context()
    assert inside["trace_id"] == f"{ctx.trace_id:032x}" and inside["span_id"] == f"{ctx.span_id:016x}"
    assert inside["task_id"] == "t2"
    assert row["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and row["span_id"] == "00f067aa0ba902b7"


def test_everything_works_without_opentelemetry(tmp_path: Path) -> None:
    """The otel extra is optional: with ``opentelemetry`` unimportable the client and the outbox import,
    enqueue writes rows without trace context, and JSON logs have no ids. (The server always has
    ``opentelemetry-api``: FastAPI itself depends on it.)"""
    code = textwrap.dedent(
        f"""
        import sys, importlib.abc

        class NoOtel(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(name)
                return None

        sys.meta_path.insert(0, NoOtel())
        import logging, sqlalchemy as sa
        import orbit_client, outbox_adapter, outbox_adapter.cli
        from orbit_client import _tracing, JsonFormatter
        from outbox_adapter import Outbox, enqueue
        assert not _tracing.AVAILABLE
        assert not any(m.startswith("opentelemetry") for m in sys.modules)
        engine = sa.create_engine("sqlite:///{tmp_path / "no-otel.db"}")
        outbox = Outbox(engine)
        outbox.migrate()
        with engine.begin() as conn:
            row = enqueue(conn, namespace="shop", queue="q", handler="h", params={{}})
        with engine.connect() as conn:
            assert conn.scalar(sa.select(outbox.tables.outbox.c.traceparent)) is None
        record = logging.LogRecord("x", logging.INFO, "", 0, "m", (), None)
        assert "trace_id" not in JsonFormatter().format(record)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
