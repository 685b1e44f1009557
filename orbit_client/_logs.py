"""JSON log lines for every Orbit process (server, relay, consumer, worker): one object per record.

Log records carry their facts as ``extra`` attributes (``event``, ``task_id``, ``row_id``,
``attempt_id``, ...); :class:`JsonFormatter` writes them beside ``ts``, ``level``, ``logger``
and ``message``, plus ``trace_id`` and ``span_id`` of the record's trace (README "Tracing"):
the ones the record carries, else those of the span active when it is formatted, else none.
Params are never logged, nor API keys or database passwords.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from orbit_client import _tracing

__all__ = ["JsonFormatter"]

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, RFC 3339), ``level``, ``logger``, ``message``, the
    record's extras and, inside a trace, ``trace_id`` (32 hex digits) and ``span_id`` (16)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                data[key] = value
        if "trace_id" not in data and _tracing.AVAILABLE:
            data.update(_tracing.log_ids())
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)
