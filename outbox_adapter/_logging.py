"""Structured logs for the relay and the CLI: one line per event, text or JSON.

Log records of ``outbox_adapter`` carry their facts as ``extra`` attributes
(``event``, ``row_id``, ``idempotency_key``, ``orbit_task_id``, ``attempts``,
``status_code``, ...); :class:`JsonFormatter` writes them as one JSON object per line, with
``trace_id`` and ``span_id`` of the row's or event's trace (the formatter of every Orbit process).
Params are never logged, nor API keys or database passwords.
"""

from __future__ import annotations

import logging
import sys

from orbit_client._logs import JsonFormatter

__all__ = ["JsonFormatter", "configure_logging"]


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send logs to stderr as ``text`` or ``json`` lines, unless the process already configured logging.

    Like :func:`logging.basicConfig`: when the root logger already has handlers (an
    application, or pytest), it is left alone. Calling it again replaces its own handler.
    """
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, "_orbit_outbox", False):
            root.removeHandler(existing)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._orbit_outbox = True  # type: ignore[attr-defined]
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every request line at INFO; the relay logs what matters itself.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
