"""The fast lane: the hot worker calls' plain happy path, served without FastAPI's routing (``ORBIT_FAST_LANE``).

A worker's calls (``start``, ``heartbeat``, ``complete``, ``fail``, single and batched, and ``leases``)
are most of a busy server's requests, and each crossed FastAPI's routing (a regular expression per
route until one matches), its dependency injection (the bearer key, the app's state, path parameters
checked against their patterns) and two body-checking middlewares before its route function ran: more
server CPU than the transaction's own statements (issue 28, ``python -m bench.call_floor``).

:class:`FastLane` sits inside :class:`~orbit_server.api.middleware.RequestContextMiddleware` (request
id, body limit and timeout, 503/500, metrics, access log) and ``ORBIT_ALLOWED_HOSTS``, in front of the
FastAPI app. For a request that is plainly on the happy path — ``POST`` to one of those routes, no
query string, ``Content-Type: application/json``, a path whose names match their pattern, a bearer key
already in the process's key cache whose namespace is the path's and whose role may ``work``, a UTF-8
body that ``json.loads`` parses and the route's request model validates (as FastAPI parses and
validates it) — it calls the route's own function (the very ``endpoint`` of the :class:`APIRoute`)
with the arguments FastAPI would have injected, the same way FastAPI does (a ``def`` in the thread pool
with :func:`run_in_threadpool`, an ``async def`` awaited on the loop), and answers its response. A
domain error raised by the function is answered by the app's own exception handler
(:mod:`.problems`), with its headers. ``scope["route"]`` is set to the route, so metrics and logs
name the same route template.

Everything else — a doubt of any kind, found before the route's function runs — goes on to the
FastAPI app with the body already read replayed, so every error answer is the full path's by
construction. Requests that FastAPI's own telemetry traces (a tracer, meter or logger provider is
configured) also take the full path, so their spans are unchanged.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orbit_client import NAME_PATTERN
from orbit_server.api.bodies import encoding_problem

__all__ = ["FastLane"]

_NAME = re.compile(NAME_PATTERN)
_PREFIX = "/v1/namespaces/"
_ACTIONS = ("start", "heartbeat", "complete", "fail")
_SINGLE = "/v1/namespaces/{namespace}/attempts/{attempt_id}/"
_BATCH = "/v1/namespaces/{namespace}/attempts/"
_LEASE = "/v1/namespaces/{namespace}/queues/{queue}/leases"
#: What the fast lane can give a route's function, by parameter name (as FastAPI injects it).
_ARGUMENTS = frozenset(
    {
        "namespace",
        "attempt_id",
        "queue",
        "body",
        "caller",
        "request",
        "engine",
        "settings",
        "wakeup",
        "metrics",
    }
)


class _Lane:
    """One route of the fast lane: its APIRoute, its function and its request model."""

    __slots__ = ("body", "call", "is_async", "params", "route")

    def __init__(self, route: APIRoute) -> None:
        self.route = route
        self.call = route.endpoint
        self.is_async = inspect.iscoroutinefunction(route.endpoint)
        self.params = frozenset(inspect.signature(route.endpoint).parameters)
        if not self.params <= _ARGUMENTS:
            raise TypeError(f"the fast lane cannot give {sorted(self.params - _ARGUMENTS)} to {route.path}")
        field = route.body_field
        annotation = getattr(getattr(field, "field_info", None), "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise TypeError(f"the fast lane needs a route whose body is one model: {route.path}")
        self.body: type[BaseModel] = annotation


def _api_routes(app: FastAPI) -> Iterator[tuple[APIRoute, str, bool]]:
    """Every APIRoute of ``app`` in routing order: ``(route, the path it serves, whether its router adds
    nothing to it)`` — routers are included without prefix, dependencies or body limit."""
    for route in app.routes:
        if isinstance(route, APIRoute):
            yield route, route.path, True
            continue
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is None:
            continue
        include = route.include_context  # type: ignore[attr-defined]
        plain = not include.prefix and not include.dependencies and include.max_body_size is None
        for context in contexts():
            if isinstance(context.original_route, APIRoute):
                yield context.original_route, context.path, plain


def _lanes(app: FastAPI) -> dict[str, _Lane]:
    """The fast lane's routes of ``app`` by template (the first ``POST`` route of each)."""
    wanted = {_SINGLE + a for a in _ACTIONS} | {_BATCH + a for a in _ACTIONS} | {_LEASE}
    lanes: dict[str, _Lane] = {}
    for route, path, plain in _api_routes(app):
        if path in wanted and "POST" in (route.methods or ()) and path not in lanes:
            if not plain or route.path != path or route.dependencies:
                raise RuntimeError(f"the fast lane cannot serve {path}: its router adds to it")
            lanes[path] = _Lane(route)
    missing = wanted - set(lanes)
    if missing:
        raise RuntimeError(f"the fast lane's routes are missing from the app: {sorted(missing)}")
    return lanes


class FastLane:
    """ASGI middleware: the hot worker routes' happy path without FastAPI's routing (module docstring)."""

    def __init__(self, app: ASGIApp, *, orbit: FastAPI) -> None:
        self.app = app
        self.orbit = orbit
        self.state = orbit.state
        self.lanes = _lanes(orbit)
        self.single = {a: self.lanes[_SINGLE + a] for a in _ACTIONS}
        self.batch = {a: self.lanes[_BATCH + a] for a in _ACTIONS}
        self.lease = self.lanes[_LEASE]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane, kwargs = self._match(scope)
        if lane is None:
            await self.app(scope, receive, send)
            return
        # The body, read here; on any doubt the full app gets it replayed (and a receive error raised again).
        messages: list[Message] = []
        body = b""
        failed: BaseException | None = None
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        except Exception as exc:
            failed = exc
        model = None
        if failed is None and messages[-1]["type"] == "http.request":
            model = _parsed(lane.body, body)
        if model is None:
            await self.app(scope, _replay(messages, failed, receive), send)
            return
        # From here on the route's function runs: no falling through any more.
        scope["route"] = lane.route
        scope["endpoint"] = lane.call
        request = Request(scope, receive)
        state = self.state
        given = {
            **kwargs, "body": model, "request": request, "engine": state.engine, "settings": state.settings,
            "wakeup": state.wakeup, "metrics": state.metrics,
        }  # fmt: skip
        kwargs = {name: given[name] for name in lane.params}
        try:
            if lane.is_async:
                response = await lane.call(**kwargs)
            else:
                response = await run_in_threadpool(lane.call, **kwargs)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        if not isinstance(
            response, Response
        ):  # each lane's function answers a Response (its answer serialised once)
            raise TypeError(f"{lane.route.path} answered {type(response).__name__}, not a Response")
        await response(scope, receive, send)

    def _match(self, scope: Scope) -> tuple[_Lane | None, dict[str, Any]]:
        """The lane of a request on the plain happy path so far (no body read), and its arguments."""
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope.get("query_string")
            or scope.get("root_path")
            or scope.get("fastapi.telemetry") is not None
            or self.orbit.dependency_overrides
        ):
            return None, {}
        path: str = scope["path"]
        if not path.startswith(_PREFIX):
            return None, {}
        parts = path[len(_PREFIX) :].split("/")
        kwargs: dict[str, Any]
        if len(parts) == 4 and parts[1] == "attempts" and parts[3] in self.single and parts[2]:
            lane = self.single[parts[3]]
            kwargs = {"attempt_id": parts[2]}
        elif len(parts) == 3 and parts[1] == "attempts" and parts[2] in self.batch:
            lane = self.batch[parts[2]]
            kwargs = {}
        elif len(parts) == 4 and parts[1] == "queues" and parts[3] == "leases" and _NAME.fullmatch(parts[2]):
            lane = self.lease
            kwargs = {"queue": parts[2]}
        else:
            return None, {}
        namespace = parts[0]
        if not _NAME.fullmatch(namespace):
            return None, {}
        content_type = authorization = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                if content_type is not None:
                    return None, {}
                content_type = value
            elif name == b"authorization" and authorization is None:
                authorization = value
        if content_type != b"application/json" or authorization is None or authorization[:7] != b"Bearer ":
            return None, {}
        key = authorization[7:].decode("latin-1")
        if not key or key != key.strip():
            return None, {}
        caller = self.state.key_cache.get(key)
        if caller is None or caller.namespace != namespace or not caller.can("work"):
            return None, {}  # unknown to the cache (the full path looks it up), or refused there
        kwargs["namespace"] = namespace
        kwargs["caller"] = caller
        return lane, kwargs

    def _handler(self, exc: Exception) -> Any:
        """The app's exception handler for ``exc``, as Starlette's ExceptionMiddleware finds it."""
        handlers = self.orbit.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code in handlers:
            return handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in handlers and cls is not Exception:
                return handlers[cls]
        return None


def _parsed(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """``body`` as FastAPI reads it (``json.loads``, then the model validated from Python), or ``None``
    when anything about it is not plain: the full path then answers it."""
    if not body or encoding_problem(body[:4]) is not None:
        return None
    try:
        return model.model_validate(json.loads(body), from_attributes=True)
    except Exception:
        return None


def _replay(messages: list[Message], failed: BaseException | None, receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` again, then raises ``failed`` (if any), then reads on."""
    pending = list(messages)

    async def replayed() -> Message:
        nonlocal failed
        if pending:
            return pending.pop(0)
        if failed is not None:
            error, failed = failed, None
            raise error
        return await receive()

    return replayed
