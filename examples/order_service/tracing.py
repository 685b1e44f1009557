"""OpenTelemetry for the demo's processes: spans appended to one JSON-lines file, and a trace as a tree.

    python -m examples.order_service.tracing run SERVICE MODULE [ARGS...]   # run MODULE traced
    python -m examples.order_service.tracing tree FILE [--order ORDER_ID]   # print one order's trace

``run`` sets up the OpenTelemetry SDK (``opentelemetry-sdk``) when ``ORDER_SERVICE_TRACE_FILE``
names a file, with ``service.name`` = SERVICE, every finished span appended to that file as
one JSON object per line (any number of processes may share the file: each line is one
``write`` to a file opened for appending), then runs ``python -m MODULE ARGS...``. The demo
starts every process this way under ``--trace-file`` (README "Tracing"). A real deployment
configures its own SDK and exporter (OTLP, ...); Orbit only uses the OpenTelemetry API.

``tree`` prints the trace of one order (by default the first completed order in the file) as
an indented tree: span name, service, duration and the Orbit ids on each span.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TRACE_FILE_ENV", "install", "load_spans", "main", "order_trace", "render_tree"]

#: The file every traced demo process appends its spans to.
TRACE_FILE_ENV = "ORDER_SERVICE_TRACE_FILE"


def install(service: str, path: str) -> None:
    """Record this process's spans into ``path`` (JSON lines), as ``service``."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        def __init__(self) -> None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            for span in spans:
                os.write(self._fd, (json.dumps(_span_json(span), separators=(",", ":")) + "\n").encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            os.close(self._fd)

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    # Simple, not batched: a span is on disk when it ends, even in a process the demo SIGKILLs.
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter()))
    trace.set_tracer_provider(provider)


def _span_json(span: Any) -> dict[str, Any]:
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name.lower(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "attributes": dict(span.attributes or {}),
        "links": [f"{link.context.trace_id:032x}" for link in span.links],
    }


def load_spans(path: Path) -> list[dict[str, Any]]:
    """Every span in a JSON-lines file written by :func:`install`."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def render_tree(spans: list[dict[str, Any]], trace_id: str) -> str:
    """The spans of one trace as an indented tree, children in start order."""
    mine = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in mine}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in mine:
        children[span["parent_id"] if span["parent_id"] in ids else None].append(span)
    lines = [f"trace {trace_id}"]

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s["start_ns"]):
            ms = (span["end_ns"] - span["start_ns"]) / 1e6
            shown = {
                k.removeprefix("orbit."): v
                for k, v in span["attributes"].items()
                if k.startswith(("orbit.", "order."))
            }
            status = "" if span["status"] != "error" else " ERROR"
            facts = " ".join(f"{k}={v}" for k, v in shown.items())
            lines.append(
                f"{'  ' * depth}{span['name']} [{span['service']}] {ms:.1f} ms{status}  {facts}".rstrip()
            )
            walk(span["span_id"], depth + 1)

    walk(None, 1)
    return "\n".join(lines)


def order_trace(spans: list[dict[str, Any]], order_id: str | None) -> str:
    """The trace id of ``order_id`` (the root span ``POST /orders`` carries ``order.id``), or of the
    first order whose trace reached the inbox when ``None``."""
    roots = [s for s in spans if s["name"] == "POST /orders" and s["attributes"].get("order.id")]
    names: dict[str, set[str]] = defaultdict(set)
    for span in spans:
        names[span["trace_id"]].add(span["name"])
    if order_id is None:  # the order whose trace shows the most kinds of span (ties: the first placed)
        ranked = sorted(
            (r for r in roots if "orbit.inbox.apply" in names[r["trace_id"]]),
            key=lambda r: (-len(names[r["trace_id"]]), r["start_ns"]),
        )
        if ranked:
            return str(ranked[0]["trace_id"])
    for root in sorted(roots, key=lambda s: s["start_ns"]):
        if root["attributes"]["order.id"] == order_id:
            return str(root["trace_id"])
    raise SystemExit(f"no trace for order {order_id or '(any completed)'} in the file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"] and len(argv) >= 3:
        service, module, rest = argv[1], argv[2], argv[3:]
        path = os.environ.get(TRACE_FILE_ENV)
        if path:
            install(service, path)
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m examples.order_service.tracing tree")
    parser.add_argument("command", choices=["tree"])
    parser.add_argument("file", type=Path, help="the --trace-file of a demo run")
    parser.add_argument("--order", help="the order's id (ord_...); default: the first completed order")
    parser.add_argument("--json", action="store_true", help="print the trace's spans as JSON instead")
    args = parser.parse_args(argv)
    spans = load_spans(args.file)
    trace_id = order_trace(spans, args.order)
    if args.json:
        print(json.dumps([s for s in spans if s["trace_id"] == trace_id], indent=2))
    else:
        print(render_tree(spans, trace_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
