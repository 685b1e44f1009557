"""Request descriptions: what one API call sends and how its answer is read, with no I/O.

Every call of :class:`~orbit_client.OrbitClient` and :class:`~orbit_client.AsyncOrbitClient` is
written once, as a function that checks its arguments and returns a :class:`_Call` (method, quoted
path, JSON body, headers, query parameters, whether it may be retried, and the function that parses
a 2xx answer). The two clients only send it (``_send``), each with its own I/O (STYLE habit 5, as
httpx's shared ``BaseClient``). The area modules hold the calls: :mod:`._task_calls`,
:mod:`._attempt_calls`, :mod:`._delivery_calls`, :mod:`._schedule_calls` (and, in the older
style, :mod:`._queue_control` and :mod:`._flows`).

Nothing here may import a client module: the arrows run client → area calls → this module.
"""

from __future__ import annotations

import email.utils
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from orbit_client import _tracing
from orbit_client._exceptions import OrbitAPIError, OrbitUsageError
from orbit_client._models import is_valid_idempotency_key

__all__: list[str] = []

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

_DELTA_SECONDS = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True, slots=True)
class _Call(Generic[_T]):
    """One API call, described: what to send and how to read a 2xx answer. Sends nothing.

    Attributes:
        method, path: the HTTP method and the path relative to ``base_url``, already quoted.
        parse: turns the 2xx response into the call's result (raises :class:`OrbitAPIError` when
            the body does not fit).
        json, headers, params: the JSON body (``None``: none), extra headers, query parameters.
        retry: whether the client's :class:`~orbit_client.RetryPolicy` may send it again; ``False``
            for a non-idempotent call that carries no idempotency key.
        extra_timeout: seconds added to the client's read timeout for this call (a long poll);
            ``None`` keeps the client's timeout.
        absent_code: a ``404`` with this problem ``code`` answers ``None`` instead of raising
            (a lookup that may find nothing); ``None``: every 404 raises.
        content: the JSON body already encoded, sent byte for byte (``application/json``) instead of
            ``json``: the bytes a caller measured are the bytes sent, whatever ``httpx`` version encodes.
        retry_content: with ``content``, the body of every try after the first (a call whose first
            try must not be repeated whole); ``None``: every try sends ``content``.
    """

    method: str
    path: str
    parse: Callable[[httpx.Response], _T]
    json: Any = None
    headers: Mapping[str, str] | None = None
    params: Mapping[str, str] | None = None
    retry: bool = True
    extra_timeout: float | None = None
    absent_code: str | None = None
    content: bytes | None = None
    retry_content: bytes | None = None


class _Sends:
    """Base of the sync area mixins: their calls go through the client's ``_send``."""

    if TYPE_CHECKING:

        def _send(self, call: _Call[_T]) -> _T: ...


class _SendsAsync:
    """Base of the async area mixins: their calls go through the async client's ``_send``."""

    if TYPE_CHECKING:

        async def _send(self, call: _Call[_T]) -> _T: ...


# --- building requests -------------------------------------------------------------------------------


def _quote_segment(segment: str, what: str) -> str:
    """Percent-encode one path segment (``/`` included), so it can never change the route."""
    if not isinstance(segment, str) or not segment:
        raise OrbitUsageError(f"{what} must be a non-empty string")
    quoted = quote(segment, safe="")
    if quoted in (".", ".."):  # dot segments would be resolved away by URL normalisation
        quoted = quoted.replace(".", "%2E")
    return quoted


def _path(template: str, *segments: str) -> str:
    """Fill ``{}`` placeholders of ``template`` with URL-quoted ``segments``.

    ``_path("/v1/namespaces/{}/tasks/{}", ns, task_id)``. Raises :class:`OrbitUsageError`
    if a segment is empty or not a string.
    """
    return template.format(*(_quote_segment(s, "a path segment") for s in segments))


def _check_key(idempotency_key: str) -> None:
    """Raise :class:`OrbitUsageError` unless the key is well-formed (DESIGN §3), before anything is sent."""
    if not isinstance(idempotency_key, str) or not is_valid_idempotency_key(idempotency_key):
        raise OrbitUsageError(
            "idempotency_key must be 1-255 printable ASCII characters (0x20-0x7E) without leading "
            "or trailing spaces (IETF Idempotency-Key draft; README, section HTTP API); nothing was sent"
        )


def _key_headers(idempotency_key: str, traceparent: str | None = None, tracestate: str | None = None,
                 *, trace: bool = False) -> dict[str, str]:  # fmt: skip
    """``Idempotency-Key`` (checked as for tasks) and, with ``trace``, the W3C trace headers."""
    _check_key(idempotency_key)
    headers = {"Idempotency-Key": idempotency_key}
    if not trace:
        return headers
    if traceparent is None and _tracing.AVAILABLE:
        traceparent, tracestate = _tracing.current()
    if traceparent is not None:
        if _tracing.parse_traceparent(traceparent) is None:
            raise OrbitUsageError(
                "traceparent is not a W3C version-00 traceparent (00-<32 hex>-<16 hex>-<2 hex>, lower "
                'case; README "Tracing"); nothing was sent'
            )
        headers["traceparent"] = traceparent
        if tracestate:
            headers["tracestate"] = tracestate
    return headers


def _body(model: type[BaseModel], what: str, **fields: Any) -> dict[str, Any]:
    """Validate ``fields`` as ``model``; return the JSON body. Sends nothing.

    Raises :class:`OrbitUsageError` naming the bad fields (never their values).
    """
    return _validated(model, what, **fields).model_dump(mode="json")


def _validated(model: type[_M], what: str, **fields: Any) -> _M:
    """``fields`` as ``model``, or :class:`OrbitUsageError` naming the bad fields (as :func:`_body`)."""
    try:
        return model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {problems}") from None


def _model(model: type[_M], fields: Mapping[str, Any], what: str) -> _M:
    """Build ``model`` from a mapping, as :func:`_body` does (usage error on bad fields)."""
    return model.model_validate(_body(model, what, **dict(fields)))


def _check_limit(limit: int) -> dict[str, str]:
    """The ``limit`` query parameter of a list call (1-1000)."""
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise OrbitUsageError(f"limit must be between 1 and 1000, not {limit!r}")
    return {"limit": str(limit)}


# --- reading answers ---------------------------------------------------------------------------------


def _target(request: httpx.Request) -> str:
    """``METHOD /path`` of a request, for messages and logs (never its body or headers)."""
    return f"{request.method} {request.url.raw_path.decode('ascii')}"


def _invalid_response(response: httpx.Response, message: str) -> OrbitAPIError:
    """The error of a 2xx answer whose body does not fit: the request may have been performed."""
    return OrbitAPIError(
        f"{_target(response.request)}: {message}",
        status_code=response.status_code,
        code="invalid_response",
        request_id=response.headers.get("X-Request-Id"),
        outcome_known=False,
    )


def _parse_model(model: type[_M], response: httpx.Response) -> _M:
    """Parse a 2xx body into ``model``; a body that does not fit raises :class:`OrbitAPIError`."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise _invalid_response(
            response,
            f"the server answered {response.status_code} but the body is not a valid {model.__name__} "
            f"({exc.error_count()} errors); the request may have been performed; check that the client "
            "and server versions match",
        ) from None


@functools.cache
def _list_adapter(model: type[_M]) -> TypeAdapter[list[_M]]:
    """The validator of a JSON array of ``model``, built once per model (building one costs more
    than validating a lease answer with it)."""
    return TypeAdapter(list[model])  # type: ignore[valid-type]


def _parse_list(model: type[_M], response: httpx.Response) -> list[_M]:
    """Parse a 2xx JSON array of ``model``; a body that does not fit raises :class:`OrbitAPIError`."""
    try:
        return _list_adapter(model).validate_json(response.content)
    except ValidationError as exc:
        raise _invalid_response(
            response,
            f"the server answered {response.status_code} but the body is not a list of {model.__name__} "
            f"({exc.error_count()} errors); the request may have been performed; check that the client "
            "and server versions match",
        ) from None


def _one(model: type[_M]) -> Callable[[httpx.Response], _M]:
    """The parser of a call that answers one ``model``."""
    return lambda response: _parse_model(model, response)


def _many(model: type[_M]) -> Callable[[httpx.Response], list[_M]]:
    """The parser of a call that answers a list of ``model``."""
    return lambda response: _parse_list(model, response)


def _nothing(response: httpx.Response) -> None:
    """The parser of a call whose answer carries nothing the caller needs."""


def _parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` value (RFC 9110 §10.2.3).

    Accepts delta-seconds (``"120"``) or an HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``,
    compared with ``now``, default the current UTC time; a past date gives ``0.0``).
    Returns ``None`` when the value is absent or unparsable.
    """
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": HTTP-dates are always GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
