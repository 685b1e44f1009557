"""The Orbit HTTP clients: :class:`OrbitClient` (blocking) and :class:`AsyncOrbitClient` (asyncio).

Every call is described once, with no I/O, by a function in its area module (:mod:`._task_calls`,
:mod:`._attempt_calls`, :mod:`._delivery_calls`, :mod:`._schedule_calls`; :mod:`._calls` holds the
description, :class:`~orbit_client._calls._Call`); the area mixins give both clients the same
methods over it. Configuration and error classification live in :class:`_BaseClient`, which does
no I/O either; each client writes only its own send/retry loop (the layout of encode/httpx). Every ``httpx`` exception is translated into an
:class:`~orbit_client.OrbitError` at this boundary.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import httpx
from pydantic import ValidationError

from orbit_client._attempt_calls import AsyncAttemptCallsMixin, AttemptCallsMixin
from orbit_client._calls import _Call, _parse_list, _parse_model, _parse_retry_after, _path, _target
from orbit_client._delivery_calls import AsyncDeliveryCallsMixin, DeliveryCallsMixin
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
from orbit_client._http import AsyncHTTPClient, HTTPClient
from orbit_client._problem import Problem
from orbit_client._queue_control import AsyncQueueControlMixin, QueueControlMixin
from orbit_client._retry import RetryPolicy, _CallRetries
from orbit_client._schedule_calls import AsyncScheduleCallsMixin, ScheduleCallsMixin
from orbit_client._task_calls import AsyncTaskCallsMixin, TaskCallsMixin
from orbit_client._version import __version__

__all__ = ["AsyncOrbitClient", "OrbitClient"]

logger = logging.getLogger("orbit_client")

_USER_AGENT = f"orbit-client/{__version__}"
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")
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
#: Most request paths whose joined URL a client keeps (:meth:`_BaseClient._url`).
_URL_CACHE_SIZE = 256

_T = TypeVar("_T")


class _BaseClient:
    """Configuration, request building and error mapping shared by both clients. No I/O.

    The calls themselves are described once, in the area mixins (:mod:`._calls`); each client only
    sends them.
    """

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
        #: Request path → its absolute URL (:meth:`_url`).
        self._urls: dict[str, httpx.URL] = {}

    def __repr__(self) -> str:  # never shows the api key
        return f"{type(self).__name__}(base_url={str(self._base_url)!r}, retry={self._retry!r})"

    # --- requests ------------------------------------------------------------------------------------

    #: For the mixins written over ``_request`` (queue control, flows).
    _path = staticmethod(_path)
    _parse_model = staticmethod(_parse_model)
    _parse_list = staticmethod(_parse_list)

    def _url(self, http: httpx.Client | httpx.AsyncClient, path: str) -> httpx.URL:
        """``path`` joined to ``base_url``, as ``httpx`` joins it, parsed once per path: an absolute
        ``httpx.URL`` is taken as it is by ``build_request``, where a relative string is parsed and
        joined again on every request (a third of the cost of building one). Raises ``httpx.InvalidURL``."""
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) >= _URL_CACHE_SIZE:  # paths naming one task or attempt each
                self._urls.clear()
            url = self._urls[path] = http.build_request("GET", path).url
        return url

    def _build_request(
        self,
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        *,
        json: Any,
        headers: Mapping[str, str] | None,
        params: Mapping[str, str] | None,
        timeout: float | None = None,
        content: bytes | None = None,
    ) -> httpx.Request:
        if http.is_closed:
            raise OrbitUsageError("the client is closed; create a new one")
        body: dict[str, Any] = {"json": json}
        if content is not None:  # encoded by the caller: sent as is
            body = {"content": content}
            headers = {**(headers or {}), "Content-Type": "application/json"}
        try:
            url = self._url(http, path)
            if timeout is not None:
                return http.build_request(
                    method, url, headers=headers, params=params, timeout=timeout, **body
                )
            return http.build_request(method, url, headers=headers, params=params, **body)
        except (TypeError, ValueError) as exc:  # e.g. NaN in the JSON body
            raise OrbitUsageError(f"cannot encode the request body as JSON: {exc}") from exc
        except httpx.InvalidURL as exc:
            raise OrbitUsageError(f"invalid request URL: {exc}") from exc

    def _call_timeout(self, call: _Call[Any]) -> float | None:
        """The call's own timeout in seconds: the client's read timeout plus its long poll, if any."""
        if call.extra_timeout is None:
            return None
        return (self._timeout.read or 10.0) + call.extra_timeout

    # --- responses -----------------------------------------------------------------------------------

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


class OrbitClient(
    _BaseClient,
    TaskCallsMixin,
    AttemptCallsMixin,
    DeliveryCallsMixin,
    ScheduleCallsMixin,
    QueueControlMixin,
    FlowMixin,
):
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
        self._http = HTTPClient(
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
        content: bytes | None = None,
        retry_content: bytes | None = None,
    ) -> httpx.Response:
        """Send a request, retrying per the policy; return the 2xx response or raise the mapped error.

        ``path`` is relative to ``base_url`` and already quoted (build it with :meth:`_path`).
        Pass ``retry=False`` for a non-idempotent request that carries no idempotency key.
        ``timeout`` replaces the client's timeout for this request, in seconds (``None``: keep it).
        ``content`` is a JSON body already encoded, sent as is instead of ``json``; ``retry_content``
        (with it) is the body of every try after the first (``None``: the same body).
        """
        request = self._build_request(
            self._http,
            method,
            path,
            json=json,
            headers=headers,
            params=params,
            timeout=timeout,
            content=content,
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
            if retry_content is not None and retries.attempt == 1:
                request = self._build_request(
                    self._http, method, path, json=None, headers=headers, params=params, timeout=timeout,
                    content=retry_content,
                )  # fmt: skip
            if self._retry.sleep is not None:
                self._retry.sleep(delay)
            else:
                time.sleep(delay)

    def _send(self, call: _Call[_T]) -> _T:
        """Send a described call (:class:`~orbit_client._calls._Call`) and parse its answer."""
        try:
            response = self._request(
                call.method,
                call.path,
                json=call.json,
                headers=call.headers,
                params=call.params,
                retry=call.retry,
                timeout=self._call_timeout(call),
                content=call.content,
                retry_content=call.retry_content,
            )
        except NotFoundError as exc:
            if call.absent_code is not None and exc.code == call.absent_code:
                return cast(_T, None)
            raise
        return call.parse(response)


class AsyncOrbitClient(
    _BaseClient,
    AsyncTaskCallsMixin,
    AsyncAttemptCallsMixin,
    AsyncDeliveryCallsMixin,
    AsyncScheduleCallsMixin,
    AsyncQueueControlMixin,
    AsyncFlowMixin,
):
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
        self._http = AsyncHTTPClient(
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
        content: bytes | None = None,
        retry_content: bytes | None = None,
    ) -> httpx.Response:
        """Async twin of :meth:`OrbitClient._request`."""
        request = self._build_request(
            self._http,
            method,
            path,
            json=json,
            headers=headers,
            params=params,
            timeout=timeout,
            content=content,
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
            if retry_content is not None and retries.attempt == 1:
                request = self._build_request(
                    self._http, method, path, json=None, headers=headers, params=params, timeout=timeout,
                    content=retry_content,
                )  # fmt: skip
            if self._retry.sleep is not None:
                self._retry.sleep(delay)
            else:
                await asyncio.sleep(delay)

    async def _send(self, call: _Call[_T]) -> _T:
        """Async twin of :meth:`OrbitClient._send`."""
        try:
            response = await self._request(
                call.method,
                call.path,
                json=call.json,
                headers=call.headers,
                params=call.params,
                retry=call.retry,
                timeout=self._call_timeout(call),
                content=call.content,
                retry_content=call.retry_content,
            )
        except NotFoundError as exc:
            if call.absent_code is not None and exc.code == call.absent_code:
                return cast(_T, None)
            raise
        return call.parse(response)
