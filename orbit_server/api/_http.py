"""uvicorn's HTTP protocol with a deadline and a size limit for a request's line and headers.

uvicorn bounds the idle time between two requests of a connection (``timeout_keep_alive``) but
not the time a client takes to send the headers of a request once it has started, or to send
its first byte after connecting: a client that sends half its headers holds the connection for
ever. This protocol closes a connection whose request line and headers are not complete
``ORBIT_HEADER_TIMEOUT_SECONDS`` after the connection was made or the request's first byte
arrived, answering ``408`` when no response is in progress. The body's deadline is the ASGI
middleware's (``ORBIT_BODY_TIMEOUT_SECONDS``, in :mod:`orbit_server.api.app`).

httptools puts no bound on the size or number of headers (a 1 MB header and 5,000 headers were
answered 200, and 8 connections sending 32 MB of headers each grew the process by 240 MB). This
protocol answers ``431 Request Header Fields Too Large`` and closes the connection once a request's
line and headers pass ``ORBIT_MAX_HEADER_BYTES`` bytes or ``ORBIT_MAX_HEADERS`` fields, counting
the bytes still buffered in an unfinished header too, so a header that never ends costs at most
the limit plus one read.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, NamedTuple

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orbit_server.settings import ServerSettings

__all__ = ["HeaderLimits", "HeaderTimeoutProtocol", "limits_of", "protocol_class", "uvicorn_options"]

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 38\r\n\r\nrequest headers not received in time\r\n"
)

_TOO_LARGE_RESPONSE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 45\r\n\r\nrequest line and headers are too large (431)\r\n"
)

#: After a 431, how long the client's remaining bytes are read and dropped before the connection closes.
_LINGER_SECONDS = 1.0


class HeaderLimits(NamedTuple):
    """What one request's line and headers may take: a deadline (seconds), bytes and fields."""

    timeout_seconds: float
    max_bytes: int
    max_fields: int


class _TooLarge(Exception):
    """Raised inside a parser callback to stop parsing a request whose headers are over the limit."""


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` plus the header deadline and size limits (:class:`HeaderLimits`)."""

    #: ``None``: read ``ORBIT_HEADER_TIMEOUT_SECONDS``, ``ORBIT_MAX_HEADER_BYTES`` and ``ORBIT_MAX_HEADERS``
    #: once per process (``serve --workers N``).
    limits: HeaderLimits | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._limits = self.limits if self.limits is not None else _env_limits()
        self._in_headers = False
        self._header_bytes = 0  # the request line and the complete header fields so far
        self._header_fields = 0
        self._unparsed = 0  # bytes fed while the headers were still incomplete
        self._too_large = False

    def data_received(self, data: bytes) -> None:
        if self._too_large:
            return
        super().data_received(data)
        if self._in_headers and not self._too_large and not self.transport.is_closing():
            # All of ``data`` is part of headers not complete yet (buffered by the parser).
            self._unparsed += len(data)
            if self._unparsed > self._limits.max_bytes:
                self._refuse_too_large()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self._limits.max_bytes or self._header_fields > self._limits.max_fields:
            self._too_large = True
            raise _TooLarge  # the parser stops; uvicorn calls send_400_response, which answers 431

    def send_400_response(self, msg: str) -> None:
        if self._too_large:
            self._refuse_too_large()
            return
        super().send_400_response(msg)

    def _refuse_too_large(self) -> None:
        """Answer 431, then read and drop what the client still sends for ``_LINGER_SECONDS`` before
        closing: closing with unread bytes would reset the connection and lose the answer."""
        self._too_large = True
        self._cancel_header_timer()
        if self.transport.is_closing():
            return
        self.transport.write(_TOO_LARGE_RESPONSE)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._header_timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = self._header_fields = self._unparsed = 0
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self._limits.timeout_seconds, self._header_timed_out)

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


def limits_of(settings: ServerSettings) -> HeaderLimits:
    return HeaderLimits(settings.header_timeout_seconds, settings.max_header_bytes, settings.max_headers)


@functools.cache
def _env_limits() -> HeaderLimits:
    return limits_of(ServerSettings())


@functools.cache
def protocol_class(limits: HeaderLimits) -> type[HeaderTimeoutProtocol]:
    """A :class:`HeaderTimeoutProtocol` subclass with these ``limits``."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"limits": limits})


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """The ``uvicorn.Config`` options that apply ``settings``' connection limits and logging.

    uvicorn's own access log is off: the app writes its own, with secrets redacted
    (``ORBIT_ACCESS_LOG``, ``ORBIT_ACCESS_LOG_REDACT``).
    """
    return {"http": protocol_class(limits_of(settings)), "access_log": False}
