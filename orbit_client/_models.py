"""Wire models: the shared basics every request, response and error body is built from.

These definitions are the single source of truth for the wire format. The server
(`orbit_server`) validates and serialises with the same classes, so the client,
the server and the OpenAPI document cannot drift apart (DESIGN §1).

Times on the wire are RFC 3339 strings in UTC with a ``Z`` suffix; in Python they
are timezone-aware :class:`datetime.datetime` objects in UTC.

This module holds the limits, the JSON and time validators and the ``_Wire`` base class. The models
are per area: :mod:`._problem` (the error body), :mod:`._task_models` (submission, tasks, batches,
reviews), :mod:`._attempt_models` (leases, attempts and their batched reports),
:mod:`._delivery_models` (result subscriptions and deliveries), :mod:`._queue_models`,
:mod:`._schedule_models`, :mod:`._flow_models`, :mod:`._settings_models`.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PlainSerializer,
    StrictFloat,
)

__all__ = [
    "IDEMPOTENCY_KEY_MAX_LENGTH",
    "JSON_MAX_DEPTH",
    "JSON_MAX_INTEGER_DIGITS",
    "NAME_PATTERN",
    "JsonData",
    "UTCDateTime",
    "canonical_json",
    "check_json_data",
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
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("datetime is out of range once converted to UTC") from None


#: Deepest nesting of arrays and objects accepted in JSON data (MySQL/MariaDB refuse deeper documents).
JSON_MAX_DEPTH = 30
#: Most digits of an integer in JSON data: Python's limit for converting integers to and from text
#: (``sys.get_int_max_str_digits()`` default), so every server process can read and write it back.
JSON_MAX_INTEGER_DIGITS = 4300
_INTEGER_LIMIT = 10**JSON_MAX_INTEGER_DIGITS
_INTEGER_LIMIT_BITS = _INTEGER_LIMIT.bit_length() - 1


def check_json_data(value: Any) -> Any:
    """Return ``value`` if it is JSON data that Orbit stores and returns unchanged; else raise ValueError.

    The rules, the same on the client, the outbox (``enqueue``) and the server, on every database:
    strings are valid Unicode (a lone surrogate is not UTF-8, RFC 8259 §8.1); numbers are finite
    (NaN and infinities, also ``1e400``, which parses as infinity, are not JSON numbers, RFC 8259 §6);
    integers have at most :data:`JSON_MAX_INTEGER_DIGITS` digits; arrays and objects nest at most
    :data:`JSON_MAX_DEPTH` levels (MySQL/MariaDB's JSON type refuses deeper documents). The
    message names the rule and its limit.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_utf8(item)
        elif isinstance(item, dict | list):
            if depth >= JSON_MAX_DEPTH:
                raise ValueError(f"JSON nested deeper than {JSON_MAX_DEPTH} levels (the limit)")
            if isinstance(item, dict):
                for key in item:
                    _check_utf8(key)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError("NaN and infinite numbers are not JSON")
        elif (
            isinstance(item, int) and item.bit_length() >= _INTEGER_LIMIT_BITS and abs(item) >= _INTEGER_LIMIT
        ):
            raise ValueError(f"an integer has more than {JSON_MAX_INTEGER_DIGITS} digits (the limit)")
    return value


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode (a lone surrogate such as \\ud800 is not)") from None


#: Any JSON value that survives storage unchanged: finite numbers, valid Unicode, bounded depth.
JsonData = Annotated[JsonValue, AfterValidator(check_json_data)]


def canonical_json(value: Any) -> Any:
    """``value`` with integral floats written as integers, as RFC 8785 (JCS) serialises numbers.

    So ``1`` and ``1.0`` mean the same in a request digest.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: canonical_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical_json(v) for v in value]
    return value


def _format_utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


#: RFC 3339 date-time (``2026-01-01T00:00:00Z``, ``...T00:00:00.5+02:00``); an offset is checked later.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,6})?([Zz]|[+-]\d{2}:\d{2})?")


def _time_text(value: Any) -> Any:
    """Let only RFC 3339 strings (and datetimes) through: never a number, which pydantic would take
    as seconds since 1970 (``deadline: 0.0`` was 1970-01-01), nor a date alone."""
    if isinstance(value, datetime) or (isinstance(value, str) and _RFC3339.fullmatch(value)):
        return value
    raise ValueError("a time is an RFC 3339 string with an offset, e.g. 2026-01-01T00:00:00Z")


#: A timezone-aware datetime, normalised to UTC, serialised as RFC 3339 with ``Z``. On input only an
#: RFC 3339 string (JSON) or a datetime (Python) is accepted, as the OpenAPI document says.
UTCDateTime = Annotated[
    datetime,
    BeforeValidator(_time_text),
    AfterValidator(_to_utc),
    PlainSerializer(_format_utc, return_type=str, when_used="json"),
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: A lease duration in seconds: at least 0.1 s, at most one hour.
LeaseSeconds = Annotated[StrictFloat, Field(ge=0.1, le=3600, allow_inf_nan=False)]
