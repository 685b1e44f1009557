"""The ``httpx`` clients the Orbit clients send with: ``httpx``'s own, with one cost taken off.

``httpx`` hands every response to its cookie jar, which first builds ``urllib``'s view of the
request and of the response (about 14 µs a response, whether or not it sets a cookie). The Orbit
API sets no cookie, and a worker sends two requests a task. Here the jar sees a response only
when the response has a ``Set-Cookie`` (or ``Set-Cookie2``) header: cookies a proxy or a load
balancer sets in front of the server are kept and sent back exactly as ``httpx`` keeps them.
"""

from __future__ import annotations

from http.cookiejar import CookieJar
from typing import Any

import httpx

__all__ = ["AsyncHTTPClient", "HTTPClient"]

_SETS_COOKIE = ("set-cookie", "set-cookie2")


class _Cookies(httpx.Cookies):
    """``httpx.Cookies`` that read a response only when it sets a cookie."""

    def extract_cookies(self, response: httpx.Response) -> None:
        headers = response.headers
        if any(name in headers for name in _SETS_COOKIE):
            super().extract_cookies(response)


class _CookiesOnDemand:
    """The ``cookies`` of an ``httpx`` client, kept in :class:`_Cookies` (``httpx`` reads and sets
    them only through this property)."""

    _orbit_cookies: httpx.Cookies

    @property
    def cookies(self) -> httpx.Cookies:
        return self._orbit_cookies

    @cookies.setter
    def cookies(
        self, cookies: httpx.Cookies | CookieJar | dict[str, str] | list[tuple[str, str]] | None
    ) -> None:
        self._orbit_cookies = _Cookies(cookies)


class HTTPClient(_CookiesOnDemand, httpx.Client):
    """``httpx.Client``, whose cookie jar reads only the responses that set a cookie."""

    def __init__(self, **kwargs: Any) -> None:
        cookies = kwargs.pop("cookies", None)
        super().__init__(**kwargs)
        self.cookies = cookies


class AsyncHTTPClient(_CookiesOnDemand, httpx.AsyncClient):
    """``httpx.AsyncClient``, whose cookie jar reads only the responses that set a cookie."""

    def __init__(self, **kwargs: Any) -> None:
        cookies = kwargs.pop("cookies", None)
        super().__init__(**kwargs)
        self.cookies = cookies
