"""The Orbit HTTP clients: :class:`OrbitClient` (blocking) and :class:`AsyncOrbitClient` (asyncio).

Request building, response parsing and error classification live in
:class:`_BaseClient`, which does no I/O; each client writes its own send/retry loop
(the layout of encode/httpx). Every ``httpx`` exception is translated into an
:class:`~orbit_client.OrbitError` at this boundary.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, JsonValue, TypeAdapter, ValidationError

from orbit_client import _tracing
from orbit_client._attempt_models import (
    MAX_ATTEMPT_BATCH_ITEMS,
    Attempt,
    AttemptBatchResponse,
    AttemptError,
    AttemptItemResult,
    AttemptState,
    CompleteBatch,
    CompleteItem,
    CompleteRequest,
    FailBatch,
    FailItem,
    FailRequest,
    HeartbeatBatch,
    HeartbeatItem,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseTokenRequest,
    StartBatch,
    StartItem,
)
from orbit_client._delivery_models import Delivery, DeliveryLeaseRequest, Subscription, SubscriptionRequest
from orbit_client._exceptions import (
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitTransportError,
    OrbitUsageError,
    _api_error,
)
from orbit_client._flows import AsyncFlowMixin, FlowMixin
from orbit_client._models import is_valid_idempotency_key
from orbit_client._problem import Problem
from orbit_client._queue_control import AsyncQueueControlMixin, QueueControlMixin
from orbit_client._queue_models import Queue
from orbit_client._retry import RetryPolicy, _CallRetries
from orbit_client._schedule_models import Schedule, ScheduleCreate, ScheduleOccurrence, ScheduleUpdate
from orbit_client._settings_models import ServerInfo
from orbit_client._task_models import (
    BatchItem,
    BatchItemResult,
    BatchSubmitResponse,
    CancelRequest,
    RetryRequest,
    ReviewRequest,
    SubmitOptions,
    SubmitResult,
    Task,
    TaskEvent,
    TaskPage,
    TaskStatus,
    TaskSubmission,
)
from orbit_client._version import __version__

__all__ = ["AsyncOrbitClient", "OrbitClient"]

logger = logging.getLogger("orbit_client")

_USER_AGENT = f"orbit-client/{__version__}"
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")
_DELTA_SECONDS = re.compile(r"\d+(?:\.\d+)?")
#: Failures where the request was never sent: the server did nothing.
_NOT_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
    httpx.UnsupportedProtocol,
)
#: Longest part of a non-problem error body kept as ``detail``, in characters.
_DETAIL_MAX = 200

_M = TypeVar("_M", bound=BaseModel)

#: The batched attempt calls: action → (batch body model, item model).
_ATTEMPT_BATCHES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "start": (StartBatch, StartItem),
    "heartbeat": (HeartbeatBatch, HeartbeatItem),
    "complete": (CompleteBatch, CompleteItem),
    "fail": (FailBatch, FailItem),
}
#: What each batched call accepts as one item: the item model, or a mapping of its fields.
StartItems = Sequence[StartItem | Mapping[str, Any]]
HeartbeatItems = Sequence[HeartbeatItem | Mapping[str, Any]]
CompleteItems = Sequence[CompleteItem | Mapping[str, Any]]
FailItems = Sequence[FailItem | Mapping[str, Any]]


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


def _quote_segment(segment: str, what: str) -> str:
    """Percent-encode one path segment (``/`` included), so it can never change the route."""
    if not isinstance(segment, str) or not segment:
        raise OrbitUsageError(f"{what} must be a non-empty string")
    quoted = quote(segment, safe="")
    if quoted in (".", ".."):  # dot segments would be resolved away by URL normalisation
        quoted = quoted.replace(".", "%2E")
    return quoted


def _check_key(idempotency_key: str) -> None:
    """Raise :class:`OrbitUsageError` unless the key is well-formed (DESIGN §3), before anything is sent."""
    if not isinstance(idempotency_key, str) or not is_valid_idempotency_key(idempotency_key):
        raise OrbitUsageError(
            "idempotency_key must be 1-255 printable ASCII characters (0x20-0x7E) without leading "
            "or trailing spaces (IETF Idempotency-Key draft; README, section HTTP API); nothing was sent"
        )


def _target(request: httpx.Request) -> str:
    """``METHOD /path`` of a request, for messages and logs (never its body or headers)."""
    return f"{request.method} {request.url.raw_path.decode('ascii')}"


class _BaseClient:
    """Configuration, request building and response parsing shared by both clients. No I/O."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str,
        timeout: float,
        retry: RetryPolicy | None,
        headers: Mapping[str, str] | None,
    ) -> None:
        try:
            url = httpx.URL(base_url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise OrbitUsageError(f"base_url is not a valid URL: {exc}") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise OrbitUsageError(
                "base_url must be an absolute http:// or https:// URL, e.g. https://orbit.example.com"
            )
        if not isinstance(api_key, str) or not _PRINTABLE_ASCII.fullmatch(api_key):
            raise OrbitUsageError("api_key must be a non-empty string of printable ASCII characters")
        if not timeout > 0:
            raise OrbitUsageError(f"timeout is in seconds and must be positive, not {timeout!r}")
        self._base_url = url
        self._retry = retry if retry is not None else RetryPolicy()
        self._timeout = httpx.Timeout(timeout)
        self._headers = httpx.Headers({"Accept": "application/json", "User-Agent": _USER_AGENT})
        self._headers.update(headers or {})
        self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:  # never shows the api key
        return f"{type(self).__name__}(base_url={str(self._base_url)!r}, retry={self._retry!r})"

    # --- requests ------------------------------------------------------------------------------------

    @staticmethod
    def _path(template: str, *segments: str) -> str:
        """Fill ``{}`` placeholders of ``template`` with URL-quoted ``segments``.

        ``_path("/v1/namespaces/{}/tasks/{}", ns, task_id)``. Raises :class:`OrbitUsageError`
        if a segment is empty or not a string.
        """
        return template.format(*(_quote_segment(s, "a path segment") for s in segments))

    @staticmethod
    def _build_request(
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        *,
        json: Any,
        headers: Mapping[str, str] | None,
        params: Mapping[str, str] | None,
        timeout: float | None = None,
    ) -> httpx.Request:
        if http.is_closed:
            raise OrbitUsageError("the client is closed; create a new one")
        try:
            if timeout is not None:
                return http.build_request(
                    method, path, json=json, headers=headers, params=params, timeout=timeout
                )
            return http.build_request(method, path, json=json, headers=headers, params=params)
        except (TypeError, ValueError) as exc:  # e.g. NaN in the JSON body
            raise OrbitUsageError(f"cannot encode the request body as JSON: {exc}") from exc
        except httpx.InvalidURL as exc:
            raise OrbitUsageError(f"invalid request URL: {exc}") from exc

    @classmethod
    def _submission_path(cls, namespace: str, idempotency_key: str) -> str:
        """Path of ``GET submissions/{key}``; a malformed key raises :class:`OrbitUsageError`."""
        _check_key(idempotency_key)
        return cls._path("/v1/namespaces/{}/submissions/{}", namespace, idempotency_key)

    @classmethod
    def _prepare_submit(
        cls,
        namespace: str,
        queue: str,
        handler: str,
        params: Any,
        idempotency_key: str,
        options: SubmitOptions | Mapping[str, Any] | None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> tuple[str, dict[str, Any], dict[str, str]]:
        """Validate a submission; return its path, JSON body and headers. Sends nothing."""
        _check_key(idempotency_key)
        headers = {"Idempotency-Key": idempotency_key}
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
        path = cls._path("/v1/namespaces/{}/tasks", namespace)
        try:
            if options is not None and not isinstance(options, SubmitOptions):
                options = SubmitOptions.model_validate(dict(options))
            submission = TaskSubmission(queue=queue, handler=handler, params=params, options=options)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            # ``from None``: pydantic's own message repeats the input, and params must never be logged.
            raise OrbitUsageError(f"invalid submission, nothing was sent: {problems}") from None
        body = submission.model_dump(mode="json", exclude_none=True)
        return path, body, headers

    @classmethod
    def _prepare_batch(
        cls, namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        """Validate a batch submission; return its path and JSON body. Sends nothing.

        Raises :class:`OrbitUsageError` for an empty batch or a malformed item, naming the
        item's index and the bad fields (never their values: params may be secret).
        """
        path = cls._path("/v1/namespaces/{}/tasks/batch", namespace)
        if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
            raise OrbitUsageError(
                "items is a list of BatchItem or mappings (one per submission); nothing was sent"
            )
        if not items:
            raise OrbitUsageError("items is empty: a batch needs at least one item; nothing was sent")
        bodies: list[dict[str, Any]] = []
        # Items without a trace context of their own continue the caller's active span, if any.
        traceparent, tracestate = _tracing.current() if _tracing.AVAILABLE else (None, None)
        for index, item in enumerate(items):
            if not isinstance(item, BatchItem):
                if not isinstance(item, Mapping):
                    raise OrbitUsageError(
                        f"items[{index}] is a {type(item).__name__}, not a BatchItem or a mapping; "
                        "nothing was sent"
                    )
                try:
                    item = BatchItem.model_validate(dict(item))
                except ValidationError as exc:
                    problems = "; ".join(
                        f"items[{index}].{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                        for e in exc.errors(include_url=False, include_input=False)
                    )
                    # ``from None``: pydantic's own message repeats the input (params may be secret).
                    raise OrbitUsageError(f"invalid batch item, nothing was sent: {problems}") from None
            body = item.model_dump(mode="json", exclude_none=True, exclude_unset=True)
            if traceparent is not None and "traceparent" not in body:
                body["traceparent"] = traceparent
                if tracestate:
                    body["tracestate"] = tracestate
            bodies.append(body)
        return path, {"items": bodies}

    @classmethod
    def _parse_batch(cls, response: httpx.Response, count: int) -> list[BatchItemResult]:
        """The per-item results of a batch; a body that does not fit raises :class:`OrbitAPIError`."""
        results = cls._parse_model(BatchSubmitResponse, response).items
        if len(results) != count:
            raise OrbitAPIError(
                f"{_target(response.request)}: the server answered {len(results)} results for {count} "
                "items; the items may have been accepted: send the same batch again (every item keeps "
                "its idempotency key) or look the keys up with find_submission()",
                status_code=response.status_code,
                code="invalid_response",
                request_id=response.headers.get("X-Request-Id"),
                outcome_known=False,
            )
        return results

    @staticmethod
    def _body(model: type[BaseModel], what: str, **fields: Any) -> dict[str, Any]:
        """Validate ``fields`` as ``model``; return the JSON body. Sends nothing.

        Raises :class:`OrbitUsageError` naming the bad fields (never their values).
        """
        try:
            value = model(**fields)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            raise OrbitUsageError(f"invalid {what}, nothing was sent: {problems}") from None
        return value.model_dump(mode="json")

    @classmethod
    def _model(cls, model: type[_M], fields: Mapping[str, Any], what: str) -> _M:
        """Build ``model`` from a mapping, as :meth:`_body` does (usage error on bad fields)."""
        return model.model_validate(cls._body(model, what, **dict(fields)))

    @classmethod
    def _attempt_call(
        cls, namespace: str, attempt_id: str, action: str, model: type[BaseModel], **fields: Any
    ) -> tuple[str, dict[str, Any]]:
        """Path and body of ``POST .../attempts/{id}/{action}``."""
        path = cls._path("/v1/namespaces/{}/attempts/{}/" + action, namespace, attempt_id)
        return path, cls._body(model, f"{action} request", **fields)

    @classmethod
    def _prepare_attempt_batch(
        cls, namespace: str, action: str, items: Sequence[BaseModel | Mapping[str, Any]]
    ) -> tuple[str, dict[str, Any]]:
        """Path and body of ``POST /v1/namespaces/{ns}/attempts/{action}`` (a batch). Sends nothing.

        Raises :class:`OrbitUsageError` for a bad item (naming its index and field, never its
        values), no item, or more than :data:`MAX_ATTEMPT_BATCH_ITEMS`.
        """
        batch_model, item_model = _ATTEMPT_BATCHES[action]
        if isinstance(items, Mapping | str | bytes) or not isinstance(items, Sequence):
            raise OrbitUsageError(
                f"items is a sequence of {item_model.__name__} or mappings; nothing was sent"
            )
        if not 1 <= len(items) <= MAX_ATTEMPT_BATCH_ITEMS:
            raise OrbitUsageError(
                f"a batch has 1 to {MAX_ATTEMPT_BATCH_ITEMS} items, not {len(items)}; nothing was sent"
            )
        path = cls._path("/v1/namespaces/{}/attempts/" + action, namespace)
        listed = [item.model_dump(mode="json") if isinstance(item, item_model) else item for item in items]
        return path, cls._body(batch_model, f"{action} batch", items=listed)

    @classmethod
    def _parse_attempt_batch(cls, response: httpx.Response, sent: int) -> list[AttemptItemResult]:
        """The item results of a 200 batch answer; one per item sent, else :class:`OrbitAPIError`."""
        results = cls._parse_model(AttemptBatchResponse, response).items
        if len(results) != sent:
            raise OrbitAPIError(
                f"{_target(response.request)}: the server answered {len(results)} results for {sent} items; "
                "the items may have been performed; check that the client and server versions match",
                status_code=response.status_code,
                code="invalid_response",
                request_id=response.headers.get("X-Request-Id"),
                outcome_known=False,
            )
        return results

    @classmethod
    def _prepare_lease(
        cls,
        namespace: str,
        queue: str,
        *,
        worker_id: str,
        max_tasks: int,
        lease_seconds: float,
        wait_seconds: float,
    ) -> tuple[str, dict[str, Any]]:
        path = cls._path("/v1/namespaces/{}/queues/{}/leases", namespace, queue)
        body = cls._body(
            LeaseRequest,
            "lease request",
            worker_id=worker_id,
            max_tasks=max_tasks,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
        )
        return path, body

    @classmethod
    def _prepare_subscription(
        cls, namespace: str, name: str, queues: Sequence[str] | None
    ) -> tuple[str, dict[str, Any]]:
        """Path and body of ``POST /v1/namespaces/{ns}/subscriptions``."""
        if isinstance(queues, str):
            raise OrbitUsageError("queues is a list of queue names, not one string; nothing was sent")
        path = cls._path("/v1/namespaces/{}/subscriptions", namespace)
        body = cls._body(
            SubscriptionRequest,
            "subscription",
            name=name,
            queues=list(queues) if queues is not None else None,
        )
        return path, body

    @classmethod
    def _prepare_delivery_lease(
        cls, namespace: str, subscription: str, max: int, lease_seconds: float
    ) -> tuple[str, dict[str, Any]]:
        """Path and body of ``POST .../subscriptions/{name}/deliveries/lease``."""
        path = cls._path("/v1/namespaces/{}/subscriptions/{}/deliveries/lease", namespace, subscription)
        body = cls._body(DeliveryLeaseRequest, "delivery lease request", max=max, lease_seconds=lease_seconds)
        return path, body

    @staticmethod
    def _list_params(
        status: TaskStatus | str | None, queue: str | None, limit: int, cursor: str | None
    ) -> dict[str, str]:
        if not 1 <= limit <= 1000:
            raise OrbitUsageError(f"limit must be between 1 and 1000, not {limit!r}")
        params = {"limit": str(limit)}
        if status is not None:
            params["status"] = TaskStatus(status).value
        if queue is not None:
            params["queue"] = queue
        if cursor is not None:
            params["cursor"] = cursor
        return params

    # --- responses -----------------------------------------------------------------------------------

    @staticmethod
    def _parse_list(model: type[_M], response: httpx.Response) -> list[_M]:
        """Parse a 2xx JSON array of ``model``; a body that does not fit raises :class:`OrbitAPIError`."""
        try:
            return TypeAdapter(list[model]).validate_json(response.content)  # type: ignore[valid-type]
        except ValidationError as exc:
            raise OrbitAPIError(
                f"{_target(response.request)}: the server answered {response.status_code} but the body is "
                f"not a list of {model.__name__} ({exc.error_count()} errors); the request may have been "
                "performed; check that the client and server versions match",
                status_code=response.status_code,
                code="invalid_response",
                request_id=response.headers.get("X-Request-Id"),
                outcome_known=False,
            ) from None

    @staticmethod
    def _parse_model(model: type[_M], response: httpx.Response) -> _M:
        """Parse a 2xx body into ``model``; a body that does not fit raises :class:`OrbitAPIError`."""
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise OrbitAPIError(
                f"{_target(response.request)}: the server answered {response.status_code} but the body is "
                f"not a valid {model.__name__} ({exc.error_count()} errors); the request may have been "
                "performed; check that the client and server versions match",
                status_code=response.status_code,
                code="invalid_response",
                request_id=response.headers.get("X-Request-Id"),
                outcome_known=False,
            ) from None

    @classmethod
    def _parse_submit(cls, response: httpx.Response) -> SubmitResult:
        """201 → a new task; 200 → replayed when ``Idempotent-Replayed: true`` (DESIGN §3)."""
        task = cls._parse_model(Task, response)
        replayed = response.status_code == 200 and (
            response.headers.get("Idempotent-Replayed", "").strip().lower() == "true"
        )
        return SubmitResult(task=task, replayed=replayed)

    @staticmethod
    def _status_error(response: httpx.Response) -> OrbitAPIError:
        """Map a non-2xx response to its :class:`OrbitAPIError` subclass (not raised)."""
        status = response.status_code
        request_id = response.headers.get("X-Request-Id")
        code, title, detail = f"http_{status}", response.reason_phrase or None, None
        problem: Problem | None = None
        try:
            problem = Problem.model_validate_json(response.content)
        except ValidationError:
            try:
                body = response.json()
            except ValueError:
                body = None
            if isinstance(body, dict):  # JSON but not a problem: keep what is usable
                code = body["code"] if isinstance(body.get("code"), str) else code
                detail = body["detail"] if isinstance(body.get("detail"), str) else None
            else:
                detail = response.text.strip()[:_DETAIL_MAX] or None
        else:
            code, title, detail = problem.code, problem.title, problem.detail
            request_id = request_id or problem.request_id
        return _api_error(
            f"{_target(response.request)} failed",
            status,
            code,
            title=title,
            detail=detail,
            request_id=request_id,
            retry_after=_parse_retry_after(response.headers.get("Retry-After")),
            problem=problem,
        )

    def _transport_error(self, exc: httpx.RequestError, request: httpx.Request) -> OrbitTransportError:
        """Classify an ``httpx`` failure by whether the request may have been sent."""
        target = _target(request)
        name = type(exc).__name__
        error: OrbitTransportError
        if isinstance(exc, _NOT_SENT):
            error = OrbitConnectError(
                f"{target}: could not connect to {request.url.host} ({name}: {exc}); the request was not "
                "sent; check base_url and that the server is up, then retry",
                method=request.method,
                url=str(request.url),
            )
        else:
            if isinstance(exc, httpx.ReadTimeout):
                what = f"no response within {self._timeout.read:g} s"
            elif isinstance(exc, httpx.WriteTimeout):
                what = "timed out while sending the request"
            else:
                what = "the connection failed after the request may have been sent"
            error = OrbitOutcomeUnknownError(
                f"{target}: {what} ({name}: {exc}); outcome unknown: the server may have accepted the "
                "request; retry with the same idempotency key or look it up with find_submission()",
                method=request.method,
                url=str(request.url),
            )
        error.__cause__ = exc  # same as ``raise error from exc``
        return error

    @staticmethod
    def _log_retry(request: httpx.Request, error: OrbitError, attempt: int, delay: float) -> None:
        # Method and path only: never the body (params) or the headers (api key).
        logger.debug(
            "retrying %s after attempt %d failed with %s (%s) in %.3f s, request id %s",
            _target(request),
            attempt,
            type(error).__name__,
            getattr(error, "code", "no response"),
            delay,
            getattr(error, "request_id", None) or "-",
        )


class OrbitClient(_BaseClient, QueueControlMixin, FlowMixin):
    """A blocking client for the Orbit HTTP API. Use it as a context manager, or call :meth:`close`.

    Every method raises :class:`~orbit_client.OrbitError` subclasses only: an
    :class:`OrbitUsageError` before anything is sent, an :class:`OrbitTransportError` when
    no answer came, an :class:`OrbitAPIError` for an error status. Retryable failures are
    retried according to ``retry`` first; the raised error's ``outcome_known`` tells
    whether the server may have performed the request.

    Args:
        base_url: the server's root URL, e.g. ``"https://orbit.example.com"``; a path prefix is kept.
        api_key: a bearer API key, bound to one namespace and a role (README "Running the server"); sent as
            ``Authorization: Bearer <api_key>`` and never logged.
        timeout: seconds allowed for each of connecting, sending, waiting for the answer
            and getting a pooled connection, per attempt. Default ``10.0``.
        retry: how failed attempts are retried; ``None`` means ``RetryPolicy()`` (4 attempts,
            0.2 s base, 5 s cap). ``RetryPolicy(max_attempts=1)`` disables retries.
        transport: an ``httpx`` transport to use instead of the network (tests, proxies);
            ``None`` means the default.
        headers: extra headers sent with every request; they cannot replace ``Authorization``.

    Raises:
        OrbitUsageError: if ``base_url`` is not an absolute http(s) URL, ``api_key`` is empty
            or not printable ASCII, or ``timeout`` is not positive.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, retry=retry, headers=headers)
        self._http = httpx.Client(
            base_url=self._base_url, headers=self._headers, timeout=self._timeout, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool. Calling it again does nothing."""
        self._http.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        retry: bool = True,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send a request, retrying per the policy; return the 2xx response or raise the mapped error.

        ``path`` is relative to ``base_url`` and already quoted (build it with :meth:`_path`).
        Pass ``retry=False`` for a non-idempotent request that carries no idempotency key.
        ``timeout`` replaces the client's timeout for this request, in seconds (``None``: keep it).
        """
        request = self._build_request(
            self._http, method, path, json=json, headers=headers, params=params, timeout=timeout
        )
        retries = _CallRetries(self._retry, enabled=retry)
        while True:
            error: OrbitError
            try:
                response = self._http.send(request)
            except httpx.RequestError as exc:
                error = self._transport_error(exc, request)
            else:
                if response.is_success:
                    return response
                error = self._status_error(response)
            delay = retries.next_delay(error)
            if delay is None:
                raise error
            self._log_retry(request, error, retries.attempt, delay)
            if self._retry.sleep is not None:
                self._retry.sleep(delay)
            else:
                time.sleep(delay)

    def submit_task(
        self,
        namespace: str,
        queue: str,
        handler: str,
        params: Any,
        *,
        idempotency_key: str,
        options: SubmitOptions | Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> SubmitResult:
        """Submit a task, at most once per idempotency key (``POST /v1/namespaces/{ns}/tasks``).

        Retried on retryable errors: safe, because every attempt carries the same
        ``Idempotency-Key`` (IETF Idempotency-Key draft; README "Using the client").

        Args:
            namespace: the namespace the API key belongs to.
            queue: the queue's name.
            handler: the handler name workers dispatch on, e.g. ``"orders.fulfil"``.
            params: any JSON value, stored and returned unchanged (no NaN or infinities).
            idempotency_key: 1-255 printable ASCII characters naming this submission; reuse
                it, and only it, when sending the same submission again.
            options: :class:`SubmitOptions` or a mapping of its fields; ``None`` means the
                server's defaults.
            traceparent, tracestate: the task's W3C Trace Context, sent as the ``traceparent``
                and ``tracestate`` headers and stored with the task (README "Tracing");
                ``None`` means the active OpenTelemetry span's, if ``opentelemetry-api`` is
                installed and a span is active, else none.

        Returns:
            The task and whether the answer was a replay of an earlier submission with the
            same key (``200`` + ``Idempotent-Replayed: true``) rather than a new task (``201``).

        Raises:
            OrbitUsageError: malformed key or invalid arguments; nothing was sent.
            IdempotencyKeyReusedError: the key already names a different submission (422).
            OrbitOutcomeUnknownError, ServerError: the task may or may not exist; retry with
                the same key or call :meth:`find_submission`.
            OrbitAPIError: any other error status (see the exception tree).
        """
        path, body, headers = self._prepare_submit(
            namespace, queue, handler, params, idempotency_key, options, traceparent, tracestate
        )
        return self._parse_submit(self._request("POST", path, json=body, headers=headers))

    def submit_tasks(
        self, namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
    ) -> list[BatchItemResult]:
        """Submit many tasks in one request (``POST /v1/namespaces/{ns}/tasks/batch``).

        Each item is handled exactly as :meth:`submit_task` would handle it alone (same
        request digest, replay and ``idempotency_key_reused`` rules), all in one server
        transaction; one bad item never fails the others. Two items with the same key are
        handled one after the other (the second replays the first). Retried on retryable
        errors like :meth:`submit_task`: safe, because every item carries its own key.

        Args:
            namespace: the namespace the API key belongs to.
            items: 1 to ``ORBIT_MAX_BATCH_ITEMS`` (server setting, default 500) items, each a
                :class:`BatchItem` or a mapping of its fields: ``{"idempotency_key": str,
                "queue": str, "handler": str, "params": <JSON>, "options": {...},
                "traceparent": str, "tracestate": str}`` (all but the first three optional;
                an item without ``traceparent`` gets the active OpenTelemetry span's, if any:
                README "Tracing"). The whole body must also fit the server's
                ``ORBIT_MAX_BODY_BYTES`` (default 256 KiB).

        Returns:
            One :class:`BatchItemResult` per item, in the order given: ``status`` 201 (a new
            ``task``), 200 (``replayed``: the original ``task``), or an error status with the
            problem body the single endpoint would answer as ``error``: 400
            ``idempotency_key_invalid``, 404 ``queue_not_found``, 409 ``request_in_progress``
            (send that item again with the same key), 422 ``idempotency_key_reused`` or
            ``validation_error``. Per-item errors are results, never raised.

        Raises:
            OrbitUsageError: ``items`` is empty or an item is malformed (bad key, queue name,
                params or options); nothing was sent.
            PayloadTooLargeError: the body exceeds the server's limit (413): split the batch.
            UnprocessableEntityError: ``validation_error`` for the request as a whole, e.g.
                more items than ``ORBIT_MAX_BATCH_ITEMS`` (422).
            OrbitOutcomeUnknownError, ServerError: some or all items may have been accepted;
                send the same batch again (same keys) or call :meth:`find_submission`.
            OrbitAPIError: any other error status (401, 403, ...; see the exception tree).
        """
        path, body = self._prepare_batch(namespace, items)
        return self._parse_batch(self._request("POST", path, json=body), len(body["items"]))

    def get_task(self, namespace: str, task_id: str) -> Task:
        """Fetch a task (``GET /v1/namespaces/{ns}/tasks/{id}``).

        Raises:
            NotFoundError: no such task in this namespace (also for another namespace's ids).
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/tasks/{}", namespace, task_id)
        return self._parse_model(Task, self._request("GET", path))

    def find_submission(self, namespace: str, idempotency_key: str) -> Task | None:
        """Find the task an idempotency key created (``GET /v1/namespaces/{ns}/submissions/{key}``).

        This is how to settle an outcome-unknown submission (README "Using the client").

        Returns:
            The task, or ``None`` when the server answers 404 ``submission_not_found``
            (nothing was accepted under this key, or it expired after its retention window).

        Raises:
            OrbitUsageError: malformed key; nothing was sent.
            NotFoundError: any other 404, e.g. an unknown namespace.
            OrbitAPIError: 410 ``task_purged``: the key is remembered but its finished task was
                purged; ``error.problem.task_id`` names it (README "Retention and the key window").
            OrbitError: as for every call.
        """
        path = self._submission_path(namespace, idempotency_key)
        try:
            response = self._request("GET", path)
        except NotFoundError as exc:
            if exc.code == "submission_not_found":
                return None
            raise
        return self._parse_model(Task, response)

    def get_settings(self) -> ServerInfo:
        """The server's published settings, e.g. its key window (``GET /v1/settings``, any valid API key).

        Raises:
            NotFoundError: an older server without the route (it purges no keys: no key window).
            OrbitError: as for every call.
        """
        return self._parse_model(ServerInfo, self._request("GET", "/v1/settings"))

    def get_queue(self, namespace: str, queue: str) -> Queue:
        """Fetch a queue and its task counts per state (``GET /v1/namespaces/{ns}/queues/{queue}``).

        Raises:
            NotFoundError: no such queue or namespace.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        return self._parse_model(Queue, self._request("GET", path))

    # --- execution (DESIGN §4) ------------------------------------------------------------------------

    def lease_tasks(
        self,
        namespace: str,
        queue: str,
        *,
        worker_id: str,
        max_tasks: int = 1,
        lease_seconds: float = 30.0,
        wait_seconds: float = 0.0,
    ) -> list[LeaseGrant]:
        """Lease up to ``max_tasks`` due tasks (``POST /v1/namespaces/{ns}/queues/{queue}/leases``).

        Each grant is the task and its new attempt: ``id``, ``generation`` (the fencing
        number), the secret ``lease_token`` and ``lease_expires_at`` (UTC, server's database
        clock). Needs a ``work`` key. Not retried by the client: a lease whose answer was lost
        leaves its grants unused until they expire (the worker loop retries instead).

        Args:
            worker_id: names this worker process (1-255 characters), for operators.
            max_tasks: most grants, 1-100. Default 1.
            lease_seconds: lease duration in seconds (0.1-3600); renew it with
                :meth:`start_attempt` and :meth:`heartbeat`. Default 30.
            wait_seconds: long-poll up to this many seconds (0-60) when nothing is due; the
                request's timeout is extended by as much. Default 0: answer at once.

        Returns:
            The grants, oldest task first; empty when nothing is due.

        Raises:
            OrbitUsageError: an argument is out of range; nothing was sent.
            NotFoundError: no such queue or namespace.
            OrbitError: as for every call.
        """
        path, body = self._prepare_lease(
            namespace,
            queue,
            worker_id=worker_id,
            max_tasks=max_tasks,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
        )
        timeout = (self._timeout.read or 10.0) + wait_seconds
        response = self._request("POST", path, json=body, retry=False, timeout=timeout)
        return self._parse_list(LeaseGrant, response)

    def start_attempt(self, namespace: str, attempt_id: str, lease_token: str) -> AttemptState:
        """Confirm that the handler starts: task ``LEASED → RUNNING``, lease renewed.

        Safe to repeat (a running attempt answers its state again), so it is retried.

        Raises:
            LeaseLostError: wrong token, or the attempt no longer holds the lease (do not run it).
            NotFoundError: no such attempt in the namespace.
            OrbitError: as for every call.
        """
        path, body = self._attempt_call(
            namespace, attempt_id, "start", LeaseTokenRequest, lease_token=lease_token
        )
        return self._parse_model(AttemptState, self._request("POST", path, json=body))

    def heartbeat(
        self, namespace: str, attempt_id: str, lease_token: str, *, lease_seconds: float | None = None
    ) -> AttemptState:
        """Renew the attempt's lease; the answer's ``cancel_requested`` says whether to stop.

        Args:
            lease_seconds: the new lease in seconds from now (server's database clock);
                ``None`` keeps the duration asked for at lease time.

        Raises:
            LeaseLostError: wrong token, or the attempt no longer holds the lease: stop working.
            OrbitError: as for every call.
        """
        fields: dict[str, Any] = {"lease_token": lease_token}
        if lease_seconds is not None:
            fields["lease_seconds"] = lease_seconds
        path, body = self._attempt_call(namespace, attempt_id, "heartbeat", HeartbeatRequest, **fields)
        return self._parse_model(AttemptState, self._request("POST", path, json=body))

    def complete_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, result: JsonValue
    ) -> AttemptState:
        """Report success with a JSON ``result``: attempt and task ``SUCCEEDED``.

        Retried on retryable errors: the server answers a repeat with the same token and an
        equal result with the same state.

        Raises:
            LeaseLostError: the attempt no longer holds the lease; the task was not changed and the
                result was kept on the attempt as evidence (``evidence_recorded``).
            InvalidTransitionError: the attempt was never started.
            OrbitError: as for every call.
        """
        path, body = self._attempt_call(
            namespace, attempt_id, "complete", CompleteRequest, lease_token=lease_token, result=result
        )
        return self._parse_model(AttemptState, self._request("POST", path, json=body))

    def fail_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, error: AttemptError | Mapping[str, Any]
    ) -> AttemptState:
        """Report failure. The task is retried (``error.retryable`` and budget left), fails, or,
        after a cancel request, becomes ``CANCELLED``.

        Args:
            error: :class:`AttemptError` or a mapping of its fields (``type``, ``message``,
                ``retryable``); use type ``"cancelled"`` when stopping because of a cancel request.

        Raises:
            LeaseLostError: as for :meth:`complete_attempt`.
            OrbitError: as for every call.
        """
        error = error if isinstance(error, AttemptError) else self._model(AttemptError, error, "error")
        path, body = self._attempt_call(
            namespace, attempt_id, "fail", FailRequest, lease_token=lease_token, error=error
        )
        return self._parse_model(AttemptState, self._request("POST", path, json=body))

    def _attempt_batch(
        self, namespace: str, action: str, items: Sequence[BaseModel | Mapping[str, Any]]
    ) -> list[AttemptItemResult]:
        path, body = self._prepare_attempt_batch(namespace, action, items)
        return self._parse_attempt_batch(self._request("POST", path, json=body), len(items))

    def start_attempts(self, namespace: str, items: StartItems) -> list[AttemptItemResult]:
        """Confirm the start of many attempts in one request (``POST /v1/namespaces/{ns}/attempts/start``).

        Each item is exactly :meth:`start_attempt` for its attempt, run on the server as its own
        conditional transition: one item's refusal never undoes another's.

        Args:
            items: 1 to :data:`~orbit_client.MAX_ATTEMPT_BATCH_ITEMS` (500) :class:`StartItem`
                (``attempt_id``, ``lease_token``) or mappings of its fields.

        Returns:
            One :class:`AttemptItemResult` per item, in order: ``status`` 200 with ``attempt``,
            or 404/409 with the ``error`` problem :meth:`start_attempt` would have raised
            (``result.raise_for_status()`` raises it: :class:`LeaseLostError` etc.).

        Raises:
            OrbitUsageError: no item, too many, or an invalid one; nothing was sent.
            NotFoundError: ``not_found`` when the server predates batched attempt calls
                (upgrade it, or use the single calls); ``namespace_not_found`` for another namespace.
            OrbitError: as for every call, for the request as a whole. Retried like
                :meth:`start_attempt`: every item is safe to repeat.
        """
        return self._attempt_batch(namespace, "start", items)

    def heartbeats(self, namespace: str, items: HeartbeatItems) -> list[AttemptItemResult]:
        """Renew many leases in one request (``POST /v1/namespaces/{ns}/attempts/heartbeat``).

        Each item is exactly :meth:`heartbeat` (``attempt_id``, ``lease_token``, optional
        ``lease_seconds``); an item's ``attempt.cancel_requested`` says whether its handler
        should stop. Results, errors and retries as for :meth:`start_attempts`.
        """
        return self._attempt_batch(namespace, "heartbeat", items)

    def complete_attempts(self, namespace: str, items: CompleteItems) -> list[AttemptItemResult]:
        """Report many successes in one request (``POST /v1/namespaces/{ns}/attempts/complete``).

        Each item is exactly :meth:`complete_attempt` (``attempt_id``, ``lease_token``, JSON
        ``result``): an item refused with ``lease_lost`` had its result kept as evidence when
        its ``error.evidence_recorded`` is true. Results, errors and retries as for
        :meth:`start_attempts` (a repeat with an equal result answers 200 again).
        """
        return self._attempt_batch(namespace, "complete", items)

    def fail_attempts(self, namespace: str, items: FailItems) -> list[AttemptItemResult]:
        """Report many failures in one request (``POST /v1/namespaces/{ns}/attempts/fail``).

        Each item is exactly :meth:`fail_attempt` (``attempt_id``, ``lease_token``, ``error``).
        Results, errors and retries as for :meth:`start_attempts`.
        """
        return self._attempt_batch(namespace, "fail", items)

    def cancel_task(self, namespace: str, task_id: str, *, reason: str) -> Task:
        """Cancel a task (``admin`` key): ``WAITING``/``LEASED`` at once, ``RUNNING`` once its worker stops.

        Idempotent, so retried. Returns the task (``cancel_requested`` set).

        Raises:
            InvalidTransitionError: the task is ``SUCCEEDED``, ``FAILED`` or ``NEEDS_REVIEW``.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/tasks/{}/cancel", namespace, task_id)
        body = self._body(CancelRequest, "cancel request", reason=reason)
        return self._parse_model(Task, self._request("POST", path, json=body))

    def review_task(
        self,
        namespace: str,
        task_id: str,
        *,
        outcome: str,
        reason: str,
        evidence_ref: str,
        result: JsonValue = None,
        actor: str | None = None,
    ) -> Task:
        """Settle a ``NEEDS_REVIEW`` task (``admin`` key) as ``"succeeded"`` (with ``result``) or ``"failed"``.

        Audited on the server with the key, ``actor``, ``reason`` and ``evidence_ref``. Not
        retried by the client.

        Raises:
            InvalidTransitionError: the task is not ``NEEDS_REVIEW``.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/tasks/{}/review", namespace, task_id)
        fields: dict[str, Any] = {"outcome": outcome, "reason": reason, "evidence_ref": evidence_ref}
        if result is not None:
            fields["result"] = result
        if actor is not None:
            fields["actor"] = actor
        body = self._body(ReviewRequest, "review request", **fields)
        return self._parse_model(Task, self._request("POST", path, json=body, retry=False))

    def retry_task(
        self, namespace: str, task_id: str, *, reason: str, deadline: datetime | None = None
    ) -> Task:
        """Create the one successor (``retry_of``) of a ``FAILED`` or ``CANCELLED`` task (``admin`` key).

        Not retried by the client; after an unknown outcome, call again: a
        :class:`SuccessorExistsError` then names the successor (``successor_id``).

        Args:
            deadline: the new task's deadline (timezone-aware); ``None`` means none.

        Raises:
            SuccessorExistsError: the task was retried already.
            ConflictError: ``not_retryable``: the task is not ``FAILED`` or ``CANCELLED``.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/tasks/{}/retry", namespace, task_id)
        fields: dict[str, Any] = {"reason": reason}
        if deadline is not None:
            fields["deadline"] = deadline
        body = self._body(RetryRequest, "retry request", **fields)
        return self._parse_model(Task, self._request("POST", path, json=body, retry=False))

    def list_attempts(self, namespace: str, task_id: str) -> list[Attempt]:
        """A task's attempts, first generation first (``GET .../tasks/{id}/attempts``)."""
        path = self._path("/v1/namespaces/{}/tasks/{}/attempts", namespace, task_id)
        return self._parse_list(Attempt, self._request("GET", path))

    def list_task_events(self, namespace: str, task_id: str) -> list[TaskEvent]:
        """A task's history, oldest first (``GET .../tasks/{id}/events``)."""
        path = self._path("/v1/namespaces/{}/tasks/{}/events", namespace, task_id)
        return self._parse_list(TaskEvent, self._request("GET", path))

    def list_tasks(
        self,
        namespace: str,
        *,
        status: TaskStatus | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """A page of the namespace's tasks, oldest first (``GET /v1/namespaces/{ns}/tasks``).

        Args:
            status, queue: filters; ``None`` means any.
            limit: most tasks on the page, 1-1000. Default 100.
            cursor: the previous page's ``next_cursor``; ``None`` starts at the oldest task.
        """
        path = self._path("/v1/namespaces/{}/tasks", namespace)
        params = self._list_params(status, queue, limit, cursor)
        return self._parse_model(TaskPage, self._request("GET", path, params=params))

    # --- result events (DESIGN §4 "Result events", §6.2 of the reliability model) ---------------------

    def create_subscription(
        self, namespace: str, name: str, *, queues: Sequence[str] | None = None
    ) -> Subscription:
        """Create a subscription to the namespace's result events (``admin`` key). Idempotent.

        ``POST /v1/namespaces/{ns}/subscriptions``. It receives the result events (tasks that
        reached ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``NEEDS_REVIEW``) that occur from
        its creation on, never earlier ones. Creating it again with the same queues returns the
        existing subscription, so the call is retried.

        Args:
            name: the subscription's name, unique in the namespace (pattern of queue names).
            queues: the queue names whose events it receives (order ignored); ``None`` means
                every queue of the namespace, including queues created later.

        Returns:
            The subscription (new, or the existing one with the same queues).

        Raises:
            OrbitUsageError: an invalid name or queue name; nothing was sent.
            ConflictError: ``subscription_exists``: the name is taken with other queues.
            NotFoundError: ``queue_not_found``: a named queue does not exist.
            OrbitError: as for every call.
        """
        path, body = self._prepare_subscription(namespace, name, queues)
        return self._parse_model(Subscription, self._request("POST", path, json=body))

    def get_subscription(self, namespace: str, name: str) -> Subscription:
        """Fetch a subscription (``GET /v1/namespaces/{ns}/subscriptions/{name}``).

        Raises:
            NotFoundError: ``subscription_not_found``, or another namespace.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/subscriptions/{}", namespace, name)
        return self._parse_model(Subscription, self._request("GET", path))

    def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = 10, lease_seconds: float = 30.0
    ) -> list[Delivery]:
        """Lease up to ``max`` unacked deliveries of a subscription (``work`` or ``admin`` key).

        ``POST .../subscriptions/{name}/deliveries/lease``. Oldest first; concurrent callers
        never get the same delivery while its lease runs. Process each event, commit its effect
        (deduping by ``delivery.event.id``: delivery is at least once), then
        :meth:`ack_delivery`. A delivery not acked within ``lease_seconds`` is handed out again
        with a higher ``delivery_count``.

        Not retried by the client: an answer lost on the way only leaves its deliveries leased
        until ``lease_seconds`` pass; then they are handed out again, so nothing is lost and
        the caller may simply lease again.

        Args:
            max: most deliveries, 1-500. Default 10.
            lease_seconds: lease duration in seconds (0.1-3600), judged by the server's
                database clock. Default 30.

        Returns:
            The deliveries; empty when none is due (the call does not wait).

        Raises:
            OrbitUsageError: an argument is out of range; nothing was sent.
            NotFoundError: ``subscription_not_found``, or another namespace.
            OrbitError: as for every call.
        """
        path, body = self._prepare_delivery_lease(namespace, subscription, max, lease_seconds)
        return self._parse_list(Delivery, self._request("POST", path, json=body, retry=False))

    def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None:
        """Acknowledge a delivery once its event's effect is committed (``work`` or ``admin`` key).

        ``POST .../subscriptions/{name}/deliveries/{id}/ack``. The delivery is never handed out
        again. Idempotent (acking twice answers 200), so it is retried. If the ack is lost after
        all, the event is delivered again after its lease and the receiver's dedupe by event id
        absorbs it.

        Raises:
            NotFoundError: ``delivery_not_found`` (not a delivery of this subscription), or
                ``subscription_not_found``.
            OrbitError: as for every call.
        """
        path = self._path(
            "/v1/namespaces/{}/subscriptions/{}/deliveries/{}/ack", namespace, subscription, delivery_id
        )
        self._request("POST", path)

    # --- schedules (README "Schedules") ----------------------------------------------------------------

    def create_schedule(self, namespace: str, name: str, **fields: Any) -> Schedule:
        """Create a schedule (``admin`` key): ``POST /v1/namespaces/{ns}/schedules``.

        Args:
            name: unique in the namespace (pattern of queue names).
            fields: those of :class:`ScheduleCreate`: ``queue``, ``handler``, ``params``, exactly
                one of ``cron`` (five fields, in ``timezone``, default ``"UTC"``) and
                ``interval_seconds``, and optionally ``start_at``/``end_at`` (aware datetimes),
                ``misfire_policy`` (``skip``, ``run_once``, ``catch_up``), ``catch_up_max``,
                ``misfire_grace_seconds``, ``overlap_policy`` (``allow``, ``skip_if_running``),
                ``paused``, ``options`` (a :class:`SubmitOptions` or mapping).

        Not retried: if an answer is lost, a second call answers ``409 already_exists``; then
        :meth:`get_schedule` shows it.

        Raises:
            OrbitUsageError: invalid fields (e.g. both or neither of cron and interval); nothing sent.
            UnprocessableEntityError: ``invalid_cron`` or ``unknown_timezone``.
            NotFoundError: ``queue_not_found``. ConflictError: ``already_exists``.
            OrbitError: as for every call.
        """
        path, body = _schedule_create(namespace, name, fields)
        return self._parse_model(Schedule, self._request("POST", path, json=body, retry=False))

    def get_schedule(self, namespace: str, name: str) -> Schedule:
        """Fetch a schedule (``GET .../schedules/{name}``); ``NotFoundError`` ``schedule_not_found``."""
        path = self._path("/v1/namespaces/{}/schedules/{}", namespace, name)
        return self._parse_model(Schedule, self._request("GET", path))

    def list_schedules(self, namespace: str, *, limit: int = 100, after: str | None = None) -> list[Schedule]:
        """The namespace's schedules by name, up to ``limit`` (1-1000), those named after ``after``."""
        path, params = _schedule_list(namespace, limit, after)
        return self._parse_list(Schedule, self._request("GET", path, params=params))

    def update_schedule(self, namespace: str, name: str, **changes: Any) -> Schedule:
        """Change the given fields of a schedule (``admin`` key): ``PATCH .../schedules/{name}``.

        ``changes`` are fields of :class:`ScheduleUpdate`; the schedule gets a new ``version``. A
        changed ``cron``/``interval_seconds``/``timezone``/bound recomputes ``next_fire_at``;
        fire times already handled never fire again. Not retried (each call is a new version).

        Raises:
            OrbitUsageError: invalid or no fields; nothing was sent.
            NotFoundError: ``schedule_not_found``, ``queue_not_found``.
            UnprocessableEntityError: ``invalid_cron``, ``unknown_timezone``, ``invalid_schedule``.
            OrbitError: as for every call.
        """
        path, body = _schedule_update(namespace, name, changes)
        return self._parse_model(Schedule, self._request("PATCH", path, json=body, retry=False))

    def pause_schedule(self, namespace: str, name: str) -> Schedule:
        """Stop a schedule firing (``admin`` key; idempotent, retried)."""
        path = self._path("/v1/namespaces/{}/schedules/{}/pause", namespace, name)
        return self._parse_model(Schedule, self._request("POST", path))

    def resume_schedule(self, namespace: str, name: str) -> Schedule:
        """Let a paused schedule fire again (``admin`` key; idempotent, retried). Fire times
        passed while it was paused follow its misfire policy."""
        path = self._path("/v1/namespaces/{}/schedules/{}/resume", namespace, name)
        return self._parse_model(Schedule, self._request("POST", path))

    def delete_schedule(self, namespace: str, name: str) -> None:
        """Delete a schedule and its occurrences (``admin`` key); the tasks it created stay.

        Not retried: a lost answer makes a second call answer ``NotFoundError``
        ``schedule_not_found``, which then means it is gone.
        """
        path = self._path("/v1/namespaces/{}/schedules/{}", namespace, name)
        self._request("DELETE", path, retry=False)

    def list_occurrences(
        self, namespace: str, name: str, *, limit: int = 100, before: datetime | None = None
    ) -> list[ScheduleOccurrence]:
        """A schedule's occurrences, newest fire time first (``GET .../schedules/{name}/occurrences``).

        Each has ``scheduled_at`` (UTC), ``task_id`` (``None`` when skipped), ``status`` and
        ``skip_reason``. ``limit`` 1-1000; ``before`` (aware datetime) pages to older ones.
        """
        path, params = _occurrence_list(namespace, name, limit, before)
        return self._parse_list(ScheduleOccurrence, self._request("GET", path, params=params))


class AsyncOrbitClient(_BaseClient, AsyncQueueControlMixin, AsyncFlowMixin):
    """The asyncio twin of :class:`OrbitClient`: same methods, awaited; :meth:`aclose` to close.

    Use it as an async context manager. Constructor arguments, errors and retries are
    exactly as for :class:`OrbitClient`, except that ``transport`` is an
    ``httpx.AsyncBaseTransport``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, retry=retry, headers=headers)
        self._http = httpx.AsyncClient(
            base_url=self._base_url, headers=self._headers, timeout=self._timeout, transport=transport
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool. Calling it again does nothing."""
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        retry: bool = True,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Async twin of :meth:`OrbitClient._request`."""
        request = self._build_request(
            self._http, method, path, json=json, headers=headers, params=params, timeout=timeout
        )
        retries = _CallRetries(self._retry, enabled=retry)
        while True:
            error: OrbitError
            try:
                response = await self._http.send(request)
            except httpx.RequestError as exc:
                error = self._transport_error(exc, request)
            else:
                if response.is_success:
                    return response
                error = self._status_error(response)
            delay = retries.next_delay(error)
            if delay is None:
                raise error
            self._log_retry(request, error, retries.attempt, delay)
            if self._retry.sleep is not None:
                self._retry.sleep(delay)
            else:
                await asyncio.sleep(delay)

    async def submit_task(
        self,
        namespace: str,
        queue: str,
        handler: str,
        params: Any,
        *,
        idempotency_key: str,
        options: SubmitOptions | Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> SubmitResult:
        """Async twin of :meth:`OrbitClient.submit_task` (same arguments, result and errors)."""
        path, body, headers = self._prepare_submit(
            namespace, queue, handler, params, idempotency_key, options, traceparent, tracestate
        )
        return self._parse_submit(await self._request("POST", path, json=body, headers=headers))

    async def submit_tasks(
        self, namespace: str, items: Sequence[BatchItem | Mapping[str, Any]]
    ) -> list[BatchItemResult]:
        """Async twin of :meth:`OrbitClient.submit_tasks` (same arguments, results and errors)."""
        path, body = self._prepare_batch(namespace, items)
        return self._parse_batch(await self._request("POST", path, json=body), len(body["items"]))

    async def get_task(self, namespace: str, task_id: str) -> Task:
        """Async twin of :meth:`OrbitClient.get_task`."""
        path = self._path("/v1/namespaces/{}/tasks/{}", namespace, task_id)
        return self._parse_model(Task, await self._request("GET", path))

    async def find_submission(self, namespace: str, idempotency_key: str) -> Task | None:
        """Async twin of :meth:`OrbitClient.find_submission` (``None`` on 404 ``submission_not_found``)."""
        path = self._submission_path(namespace, idempotency_key)
        try:
            response = await self._request("GET", path)
        except NotFoundError as exc:
            if exc.code == "submission_not_found":
                return None
            raise
        return self._parse_model(Task, response)

    async def get_settings(self) -> ServerInfo:
        """Async twin of :meth:`OrbitClient.get_settings`."""
        return self._parse_model(ServerInfo, await self._request("GET", "/v1/settings"))

    async def get_queue(self, namespace: str, queue: str) -> Queue:
        """Async twin of :meth:`OrbitClient.get_queue`."""
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        return self._parse_model(Queue, await self._request("GET", path))

    # --- execution (DESIGN §4) ------------------------------------------------------------------------

    async def lease_tasks(
        self,
        namespace: str,
        queue: str,
        *,
        worker_id: str,
        max_tasks: int = 1,
        lease_seconds: float = 30.0,
        wait_seconds: float = 0.0,
    ) -> list[LeaseGrant]:
        """Async twin of :meth:`OrbitClient.lease_tasks`."""
        path, body = self._prepare_lease(
            namespace,
            queue,
            worker_id=worker_id,
            max_tasks=max_tasks,
            lease_seconds=lease_seconds,
            wait_seconds=wait_seconds,
        )
        timeout = (self._timeout.read or 10.0) + wait_seconds
        response = await self._request("POST", path, json=body, retry=False, timeout=timeout)
        return self._parse_list(LeaseGrant, response)

    async def start_attempt(self, namespace: str, attempt_id: str, lease_token: str) -> AttemptState:
        """Async twin of :meth:`OrbitClient.start_attempt`."""
        path, body = self._attempt_call(
            namespace, attempt_id, "start", LeaseTokenRequest, lease_token=lease_token
        )
        return self._parse_model(AttemptState, await self._request("POST", path, json=body))

    async def heartbeat(
        self, namespace: str, attempt_id: str, lease_token: str, *, lease_seconds: float | None = None
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.heartbeat`."""
        fields: dict[str, Any] = {"lease_token": lease_token}
        if lease_seconds is not None:
            fields["lease_seconds"] = lease_seconds
        path, body = self._attempt_call(namespace, attempt_id, "heartbeat", HeartbeatRequest, **fields)
        return self._parse_model(AttemptState, await self._request("POST", path, json=body))

    async def complete_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, result: JsonValue
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.complete_attempt`."""
        path, body = self._attempt_call(
            namespace, attempt_id, "complete", CompleteRequest, lease_token=lease_token, result=result
        )
        return self._parse_model(AttemptState, await self._request("POST", path, json=body))

    async def fail_attempt(
        self, namespace: str, attempt_id: str, lease_token: str, error: AttemptError | Mapping[str, Any]
    ) -> AttemptState:
        """Async twin of :meth:`OrbitClient.fail_attempt`."""
        error = error if isinstance(error, AttemptError) else self._model(AttemptError, error, "error")
        path, body = self._attempt_call(
            namespace, attempt_id, "fail", FailRequest, lease_token=lease_token, error=error
        )
        return self._parse_model(AttemptState, await self._request("POST", path, json=body))

    async def _attempt_batch(
        self, namespace: str, action: str, items: Sequence[BaseModel | Mapping[str, Any]]
    ) -> list[AttemptItemResult]:
        path, body = self._prepare_attempt_batch(namespace, action, items)
        return self._parse_attempt_batch(await self._request("POST", path, json=body), len(items))

    async def start_attempts(self, namespace: str, items: StartItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.start_attempts`."""
        return await self._attempt_batch(namespace, "start", items)

    async def heartbeats(self, namespace: str, items: HeartbeatItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.heartbeats`."""
        return await self._attempt_batch(namespace, "heartbeat", items)

    async def complete_attempts(self, namespace: str, items: CompleteItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.complete_attempts`."""
        return await self._attempt_batch(namespace, "complete", items)

    async def fail_attempts(self, namespace: str, items: FailItems) -> list[AttemptItemResult]:
        """Async twin of :meth:`OrbitClient.fail_attempts`."""
        return await self._attempt_batch(namespace, "fail", items)

    async def cancel_task(self, namespace: str, task_id: str, *, reason: str) -> Task:
        """Async twin of :meth:`OrbitClient.cancel_task`."""
        path = self._path("/v1/namespaces/{}/tasks/{}/cancel", namespace, task_id)
        body = self._body(CancelRequest, "cancel request", reason=reason)
        return self._parse_model(Task, await self._request("POST", path, json=body))

    async def review_task(
        self,
        namespace: str,
        task_id: str,
        *,
        outcome: str,
        reason: str,
        evidence_ref: str,
        result: JsonValue = None,
        actor: str | None = None,
    ) -> Task:
        """Async twin of :meth:`OrbitClient.review_task`."""
        path = self._path("/v1/namespaces/{}/tasks/{}/review", namespace, task_id)
        fields: dict[str, Any] = {"outcome": outcome, "reason": reason, "evidence_ref": evidence_ref}
        if result is not None:
            fields["result"] = result
        if actor is not None:
            fields["actor"] = actor
        body = self._body(ReviewRequest, "review request", **fields)
        return self._parse_model(Task, await self._request("POST", path, json=body, retry=False))

    async def retry_task(
        self, namespace: str, task_id: str, *, reason: str, deadline: datetime | None = None
    ) -> Task:
        """Async twin of :meth:`OrbitClient.retry_task`."""
        path = self._path("/v1/namespaces/{}/tasks/{}/retry", namespace, task_id)
        fields: dict[str, Any] = {"reason": reason}
        if deadline is not None:
            fields["deadline"] = deadline
        body = self._body(RetryRequest, "retry request", **fields)
        return self._parse_model(Task, await self._request("POST", path, json=body, retry=False))

    async def list_attempts(self, namespace: str, task_id: str) -> list[Attempt]:
        """Async twin of :meth:`OrbitClient.list_attempts`."""
        path = self._path("/v1/namespaces/{}/tasks/{}/attempts", namespace, task_id)
        return self._parse_list(Attempt, await self._request("GET", path))

    async def list_task_events(self, namespace: str, task_id: str) -> list[TaskEvent]:
        """Async twin of :meth:`OrbitClient.list_task_events`."""
        path = self._path("/v1/namespaces/{}/tasks/{}/events", namespace, task_id)
        return self._parse_list(TaskEvent, await self._request("GET", path))

    async def list_tasks(
        self,
        namespace: str,
        *,
        status: TaskStatus | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Async twin of :meth:`OrbitClient.list_tasks`."""
        path = self._path("/v1/namespaces/{}/tasks", namespace)
        params = self._list_params(status, queue, limit, cursor)
        return self._parse_model(TaskPage, await self._request("GET", path, params=params))

    # --- result events (DESIGN §4) --------------------------------------------------------------------

    async def create_subscription(
        self, namespace: str, name: str, *, queues: Sequence[str] | None = None
    ) -> Subscription:
        """Async twin of :meth:`OrbitClient.create_subscription`."""
        path, body = self._prepare_subscription(namespace, name, queues)
        return self._parse_model(Subscription, await self._request("POST", path, json=body))

    async def get_subscription(self, namespace: str, name: str) -> Subscription:
        """Async twin of :meth:`OrbitClient.get_subscription`."""
        path = self._path("/v1/namespaces/{}/subscriptions/{}", namespace, name)
        return self._parse_model(Subscription, await self._request("GET", path))

    async def lease_deliveries(
        self, namespace: str, subscription: str, *, max: int = 10, lease_seconds: float = 30.0
    ) -> list[Delivery]:
        """Async twin of :meth:`OrbitClient.lease_deliveries` (not retried either)."""
        path, body = self._prepare_delivery_lease(namespace, subscription, max, lease_seconds)
        return self._parse_list(Delivery, await self._request("POST", path, json=body, retry=False))

    async def ack_delivery(self, namespace: str, subscription: str, delivery_id: str) -> None:
        """Async twin of :meth:`OrbitClient.ack_delivery` (idempotent, retried)."""
        path = self._path(
            "/v1/namespaces/{}/subscriptions/{}/deliveries/{}/ack", namespace, subscription, delivery_id
        )
        await self._request("POST", path)

    # --- schedules (README "Schedules") ----------------------------------------------------------------

    async def create_schedule(self, namespace: str, name: str, **fields: Any) -> Schedule:
        """Async twin of :meth:`OrbitClient.create_schedule` (not retried)."""
        path, body = _schedule_create(namespace, name, fields)
        return self._parse_model(Schedule, await self._request("POST", path, json=body, retry=False))

    async def get_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.get_schedule`."""
        path = self._path("/v1/namespaces/{}/schedules/{}", namespace, name)
        return self._parse_model(Schedule, await self._request("GET", path))

    async def list_schedules(
        self, namespace: str, *, limit: int = 100, after: str | None = None
    ) -> list[Schedule]:
        """Async twin of :meth:`OrbitClient.list_schedules`."""
        path, params = _schedule_list(namespace, limit, after)
        return self._parse_list(Schedule, await self._request("GET", path, params=params))

    async def update_schedule(self, namespace: str, name: str, **changes: Any) -> Schedule:
        """Async twin of :meth:`OrbitClient.update_schedule` (not retried)."""
        path, body = _schedule_update(namespace, name, changes)
        return self._parse_model(Schedule, await self._request("PATCH", path, json=body, retry=False))

    async def pause_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.pause_schedule`."""
        path = self._path("/v1/namespaces/{}/schedules/{}/pause", namespace, name)
        return self._parse_model(Schedule, await self._request("POST", path))

    async def resume_schedule(self, namespace: str, name: str) -> Schedule:
        """Async twin of :meth:`OrbitClient.resume_schedule`."""
        path = self._path("/v1/namespaces/{}/schedules/{}/resume", namespace, name)
        return self._parse_model(Schedule, await self._request("POST", path))

    async def delete_schedule(self, namespace: str, name: str) -> None:
        """Async twin of :meth:`OrbitClient.delete_schedule` (not retried)."""
        path = self._path("/v1/namespaces/{}/schedules/{}", namespace, name)
        await self._request("DELETE", path, retry=False)

    async def list_occurrences(
        self, namespace: str, name: str, *, limit: int = 100, before: datetime | None = None
    ) -> list[ScheduleOccurrence]:
        """Async twin of :meth:`OrbitClient.list_occurrences`."""
        path, params = _occurrence_list(namespace, name, limit, before)
        return self._parse_list(ScheduleOccurrence, await self._request("GET", path, params=params))


# --- schedule requests, shared by both clients ------------------------------------------------------


def _schedule_body(model: type[BaseModel], what: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``fields`` as ``model``; the JSON body of the fields given. Sends nothing."""
    try:
        value = model(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {problems}") from None
    except TypeError as exc:
        raise OrbitUsageError(f"invalid {what}, nothing was sent: {exc}") from None
    return value.model_dump(mode="json", exclude_unset=True)


def _schedule_create(namespace: str, name: str, fields: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    path = _BaseClient._path("/v1/namespaces/{}/schedules", namespace)
    return path, _schedule_body(ScheduleCreate, "schedule", {"name": name, **fields})


def _schedule_update(namespace: str, name: str, changes: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    path = _BaseClient._path("/v1/namespaces/{}/schedules/{}", namespace, name)
    return path, _schedule_body(ScheduleUpdate, "schedule update", changes)


def _check_limit(limit: int) -> dict[str, str]:
    if not isinstance(limit, int) or not 1 <= limit <= 1000:
        raise OrbitUsageError(f"limit must be between 1 and 1000, not {limit!r}")
    return {"limit": str(limit)}


def _schedule_list(namespace: str, limit: int, after: str | None) -> tuple[str, dict[str, str]]:
    params = _check_limit(limit)
    if after is not None:
        params["after"] = after
    return _BaseClient._path("/v1/namespaces/{}/schedules", namespace), params


def _occurrence_list(
    namespace: str, name: str, limit: int, before: datetime | None
) -> tuple[str, dict[str, str]]:
    params = _check_limit(limit)
    if before is not None:
        if before.tzinfo is None:
            raise OrbitUsageError("before must carry a timezone offset (e.g. datetime.now(UTC))")
        params["before"] = before.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return _BaseClient._path("/v1/namespaces/{}/schedules/{}/occurrences", namespace, name), params
