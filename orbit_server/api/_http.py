"""uvicorn's HTTP protocol with a deadline for a request's line and headers (slow-loris guard).

uvicorn bounds the idle time between two requests of a connection (``timeout_keep_alive``) but
not the time a client takes to send the headers of a request once it has started, or to send
its first byte after connecting: a client that sends half its headers holds the connection for
ever. This protocol closes a connection whose request line and headers are not complete
``ORBIT_HEADER_TIMEOUT_SECONDS`` after the connection was made or the request's first byte
arrived, answering ``408`` when no response is in progress. The body's deadline is the ASGI
middleware's (``ORBIT_BODY_TIMEOUT_SECONDS``, in :mod:`orbit_server.api.app`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orbit_server.settings import ServerSettings

__all__ = ["HeaderTimeoutProtocol", "protocol_class", "uvicorn_options"]

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 38\r\n\r\nrequest headers not received in time\r\n"
)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` plus the header deadline (``header_timeout`` seconds)."""

    #: ``None``: read ``ORBIT_HEADER_TIMEOUT_SECONDS`` once per process (``serve --workers N``).
    header_timeout: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        timeout = self.header_timeout if self.header_timeout is not None else _env_header_timeout()
        self._header_timer = self.loop.call_later(timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


@functools.cache
def _env_header_timeout() -> float:
    return ServerSettings().header_timeout_seconds


@functools.cache
def protocol_class(header_timeout_seconds: float) -> type[HeaderTimeoutProtocol]:
    """A :class:`HeaderTimeoutProtocol` subclass whose deadline is ``header_timeout_seconds``."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout_seconds})


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """The ``uvicorn.Config`` options that apply ``settings``' connection limits and logging.

    uvicorn's own access log is off: the app writes its own, with secrets redacted
    (``ORBIT_ACCESS_LOG``, ``ORBIT_ACCESS_LOG_REDACT``).
    """
    return {"http": protocol_class(settings.header_timeout_seconds), "access_log": False}
