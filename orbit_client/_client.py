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
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from orbit_client._exceptions import (
    NotFoundError,
    OrbitAPIError,
    OrbitConnectError,
    OrbitError,
    OrbitOutcomeUnknownError,
    OrbitTransportError,
    OrbitUsageError,
    _api_error_class,
)
from orbit_client._models import (
    Problem,
    Queue,
    SubmitOptions,
    SubmitResult,
    Task,
    TaskSubmission,
    is_valid_idempotency_key,
)
from orbit_client._retry import RetryPolicy, _CallRetries
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
            "or trailing spaces (IETF Idempotency-Key draft, DESIGN §3); nothing was sent"
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
    ) -> httpx.Request:
        if http.is_closed:
            raise OrbitUsageError("the client is closed; create a new one")
        try:
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
    ) -> tuple[str, dict[str, Any], dict[str, str]]:
        """Validate a submission; return its path, JSON body and headers. Sends nothing."""
        _check_key(idempotency_key)
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
        return path, body, {"Idempotency-Key": idempotency_key}

    # --- responses -----------------------------------------------------------------------------------

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
        error_class = _api_error_class(status, code)
        message = f"{_target(response.request)} failed with {status} {code}"
        if detail or title:
            message += f": {detail or title}"
        if request_id:
            message += f" (request id {request_id})"
        return error_class(
            f"{message}; {error_class.hint}",
            status_code=status,
            code=code,
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


class OrbitClient(_BaseClient):
    """A blocking client for the Orbit HTTP API. Use it as a context manager, or call :meth:`close`.

    Every method raises :class:`~orbit_client.OrbitError` subclasses only: an
    :class:`OrbitUsageError` before anything is sent, an :class:`OrbitTransportError` when
    no answer came, an :class:`OrbitAPIError` for an error status. Retryable failures are
    retried according to ``retry`` first; the raised error's ``outcome_known`` tells
    whether the server may have performed the request.

    Args:
        base_url: the server's root URL, e.g. ``"https://orbit.example.com"``; a path prefix is kept.
        api_key: a bearer API key, bound to one namespace and a role (DESIGN §8); sent as
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
    ) -> httpx.Response:
        """Send a request, retrying per the policy; return the 2xx response or raise the mapped error.

        ``path`` is relative to ``base_url`` and already quoted (build it with :meth:`_path`).
        Pass ``retry=False`` for a non-idempotent request that carries no idempotency key.
        """
        request = self._build_request(self._http, method, path, json=json, headers=headers, params=params)
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
    ) -> SubmitResult:
        """Submit a task, at most once per idempotency key (``POST /v1/namespaces/{ns}/tasks``).

        Retried on retryable errors: safe, because every attempt carries the same
        ``Idempotency-Key`` (IETF Idempotency-Key draft, DESIGN §3).

        Args:
            namespace: the namespace the API key belongs to.
            queue: the queue's name.
            handler: the handler name workers dispatch on, e.g. ``"orders.fulfil"``.
            params: any JSON value, stored and returned unchanged (no NaN or infinities).
            idempotency_key: 1-255 printable ASCII characters naming this submission; reuse
                it, and only it, when sending the same submission again.
            options: :class:`SubmitOptions` or a mapping of its fields; ``None`` means the
                server's defaults.

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
            namespace, queue, handler, params, idempotency_key, options
        )
        return self._parse_submit(self._request("POST", path, json=body, headers=headers))

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

        This is how to settle an outcome-unknown submission (DESIGN §3, §5).

        Returns:
            The task, or ``None`` when the server answers 404 ``submission_not_found``
            (nothing was accepted under this key, or it expired after its retention window).

        Raises:
            OrbitUsageError: malformed key; nothing was sent.
            NotFoundError: any other 404, e.g. an unknown namespace.
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

    def get_queue(self, namespace: str, queue: str) -> Queue:
        """Fetch a queue and its task counts per state (``GET /v1/namespaces/{ns}/queues/{queue}``).

        Raises:
            NotFoundError: no such queue or namespace.
            OrbitError: as for every call.
        """
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        return self._parse_model(Queue, self._request("GET", path))


class AsyncOrbitClient(_BaseClient):
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
    ) -> httpx.Response:
        """Async twin of :meth:`OrbitClient._request`."""
        request = self._build_request(self._http, method, path, json=json, headers=headers, params=params)
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
    ) -> SubmitResult:
        """Async twin of :meth:`OrbitClient.submit_task` (same arguments, result and errors)."""
        path, body, headers = self._prepare_submit(
            namespace, queue, handler, params, idempotency_key, options
        )
        return self._parse_submit(await self._request("POST", path, json=body, headers=headers))

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

    async def get_queue(self, namespace: str, queue: str) -> Queue:
        """Async twin of :meth:`OrbitClient.get_queue`."""
        path = self._path("/v1/namespaces/{}/queues/{}", namespace, queue)
        return self._parse_model(Queue, await self._request("GET", path))
