"""The HTTP API (FastAPI).

Endpoints raise the domain errors of :mod:`orbit_server.errors`; the handlers
registered here turn each into one RFC 9457 problem body with a stable ``code``.
Every response carries ``X-Request-Id``. Handlers are plain ``def`` functions:
FastAPI runs them in its thread pool, and each opens only short transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orbit_client import (
    IDEMPOTENCY_KEY_MAX_LENGTH,
    JSON_MAX_DEPTH,
    JSON_MAX_INTEGER_DIGITS,
    NAME_PATTERN,
    Attempt,
    AttemptState,
    CancelRequest,
    CompleteRequest,
    Delivery,
    DeliveryAck,
    DeliveryLeaseRequest,
    FailRequest,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseTokenRequest,
    Problem,
    Queue,
    RetryRequest,
    ReviewRequest,
    ServerInfo,
    Subscription,
    SubscriptionRequest,
    Task,
    TaskEvent,
    TaskPage,
    TaskStatus,
    TaskSubmission,
    _tracing,
    is_valid_idempotency_key,
)
from orbit_server import errors
from orbit_server.api import tracing as server_tracing
from orbit_server.api.attempt_batches import attempt_batch_router
from orbit_server.api.auth import Caller, KeyCache, authorize
from orbit_server.api.batch import batch_router
from orbit_server.api.flows import flows_router
from orbit_server.api.metrics import Metrics, method_label
from orbit_server.api.queues import queues_router
from orbit_server.api.schedules import schedules_router
from orbit_server.console import console_router
from orbit_server.db.engine import create_engine
from orbit_server.db.sampling import sample as sample_gauges
from orbit_server.db.transact import transact
from orbit_server.flows.loop import run_flow_loop
from orbit_server.results import deliveries as results
from orbit_server.schedules.loop import run_scheduler
from orbit_server.settings import ServerSettings
from orbit_server.tasks import attempts as attempt_reports
from orbit_server.tasks import leases as leasing
from orbit_server.tasks import operations as task_ops
from orbit_server.tasks import store

__all__ = ["create_app"]

log = logging.getLogger("orbit_server.app")
#: One line per request when ``ORBIT_ACCESS_LOG`` is on (README "Running the server").
access_log = logging.getLogger("orbit_server.access")

#: The lease answer's body, serialised without a second validation (``lease_tasks``).
_LEASE_GRANTS = TypeAdapter(list[LeaseGrant])
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
_PROBLEMS: dict[int | str, dict[str, Any]] = {
    status: {"model": Problem, "content": {"application/problem+json": {}}}
    for status in (400, 401, 403, 404, 422)
}

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
QueueName = Annotated[str, Path(pattern=NAME_PATTERN, description="Queue name.")]
SubscriptionName = Annotated[str, Path(pattern=NAME_PATTERN, description="Subscription name.")]
_CONFLICTS: dict[int | str, dict[str, Any]] = {**_PROBLEMS, 409: _PROBLEMS[400]}


class Wakeup:
    """Wakes long-polling lease calls when this process makes a task due (thread-safe ``notify``).

    Tasks made due by another server process are found by polling instead.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event | None:
        """The event the next :meth:`notify` sets; take it *before* looking for due tasks."""
        return self._event

    def notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self._event = self._event, asyncio.Event()
        if event is not None:
            event.set()

    @staticmethod
    async def wait(event: asyncio.Event | None, timeout: float) -> None:
        if event is None:
            await asyncio.sleep(timeout)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


def problem_response(
    status: int, code: str, title: str, detail: str | None, request_id: str | None, **extra: Any
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, code=code, request_id=request_id, **extra)
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=status,
        media_type="application/problem+json",
    )


class _BodyTooLarge(StarletteHTTPException):
    """Raised while the body streams in (an HTTPException, so FastAPI passes it through)."""

    code = "payload_too_large"


class _BodyTimeout(StarletteHTTPException):
    """The body did not arrive within ``ORBIT_BODY_TIMEOUT_SECONDS``; the connection is closed after the 408."""

    code = "request_timeout"


#: Why FastAPI could not parse a JSON body (its 400 carries the parser's exception as ``__cause__``).
def _unreadable_body(cause: BaseException | None) -> tuple[str, str] | None:
    if isinstance(cause, UnicodeDecodeError):
        return "invalid_utf8", "the body is not valid UTF-8 (RFC 8259 §8.1)"
    if isinstance(cause, RecursionError):
        return "nesting_too_deep", (
            f"the body nests arrays and objects too deeply to parse; JSON data may nest at most "
            f"{JSON_MAX_DEPTH} levels"
        )
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "integer_too_long", (
            f"an integer in the body has more than {JSON_MAX_INTEGER_DIGITS} digits, the most JSON data may have"
        )
    return None


#: Query parameters the access log never shows (README "Running the server").
_SECRET_QUERY = re.compile(r"(?<![^&])(cursor)=[^&]*")
#: Path segments the access log never shows: idempotency keys.
_SECRET_PATH = re.compile(r"(/submissions/).+")


def _redacted_target(path: str, query: bytes) -> str:
    target = _SECRET_PATH.sub(r"\1<redacted>", path)
    if query:
        target += "?" + _SECRET_QUERY.sub(r"\1=<redacted>", query.decode("latin-1"))
    return target


class RequestContextMiddleware:
    """Request ids, the body size limit, and the last-resort 500, as plain ASGI.

    It sits outside everything else, so even a crash answers with a problem body
    and an ``X-Request-Id`` (taken from the request when well-formed, else new).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        metrics: Metrics,
        body_timeout_seconds: float = 30.0,
        access_log: bool = False,
        redact: bool = True,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.body_timeout = body_timeout_seconds
        self.access_log = access_log
        self.redact = redact

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")
        if not _REQUEST_ID_RE.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False
        status = 0
        began = time.perf_counter()
        method = scope["method"]
        head = method == "HEAD"
        if head:  # answered as the GET it asks about, without the body (RFC 9110 §9.3.2)
            scope = {**scope, "method": "GET"}

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
                route = getattr(scope.get("route"), "path", "unmatched")
                self.metrics.request_seconds.labels(route, method_label(method), str(status)).observe(
                    time.perf_counter() - began
                )
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        limit = self.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            response = problem_response(
                413, "payload_too_large", "Request body too large",
                f"the body has {length} bytes; the limit is {limit}", request_id,
            )  # fmt: skip
            await response(scope, receive, send_with_id)
            return
        received = 0
        body_done = False
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.body_timeout

        async def receive_counted() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout(
                    408,
                    f"the body did not arrive within {self.body_timeout:g} s (ORBIT_BODY_TIMEOUT_SECONDS)",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(413, f"the body exceeds the limit of {limit} bytes")
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        try:
            await self.app(scope, receive_counted, send_with_id)
        except Exception:
            log.exception("unhandled error (request_id=%s)", request_id)
            if started:
                raise
            response = problem_response(
                500, "internal_error", "Internal server error",
                f"an unexpected error occurred; quote request id {request_id} when reporting it", request_id,
            )  # fmt: skip
            await response(scope, receive, send_with_id)
        finally:
            if self.access_log:
                self._log_access(scope, method, status, began, request_id)

    def _log_access(self, scope: Scope, method: str, status: int, began: float, request_id: str) -> None:
        path, query = scope.get("path", ""), scope.get("query_string", b"")
        target = (
            _redacted_target(path, query)
            if self.redact
            else path + ("?" + query.decode("latin-1") if query else "")
        )
        client = scope.get("client")
        access_log.info(
            '%s - "%s %s HTTP/%s" %d %.1fms request_id=%s',
            f"{client[0]}:{client[1]}" if client else "-",
            method,
            target,
            scope.get("http_version", "1.1"),
            status,
            (time.perf_counter() - began) * 1000,
            request_id,
        )


#: The ``Idempotency-Key`` rule of :func:`orbit_client.is_valid_idempotency_key` as a JSON Schema pattern.
_IDEMPOTENCY_KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": IDEMPOTENCY_KEY_MAX_LENGTH,
    "pattern": r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$",
}


def _finish_openapi(app: FastAPI) -> None:
    """Mark ``Idempotency-Key`` required in the OpenAPI document, with its pattern; document the
    problem answers every operation with a body may give.

    The route takes the key as optional so that a missing or malformed key is answered with the
    documented ``400 idempotency_key_missing``/``idempotency_key_invalid``, not a 422. A body may
    be refused before any route runs: ``400`` unreadable (``invalid_utf8``, ``integer_too_long``,
    ``nesting_too_deep``), ``408 request_timeout``, ``413 payload_too_large``, ``422``.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        problem = {
            "description": "A problem (RFC 9457)",
            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                if "requestBody" in operation:
                    for status in ("400", "408", "413", "422"):
                        operation["responses"].setdefault(status, problem)
                for parameter in operation.get("parameters", []):
                    if parameter.get("in") == "header" and parameter.get("name") == "Idempotency-Key":
                        parameter["required"] = True
                        parameter["schema"] = dict(_IDEMPOTENCY_KEY_SCHEMA, title="Idempotency-Key")
                        parameter["description"] = (
                            "1-255 printable ASCII characters, no leading or trailing space; unique per "
                            'task (README "HTTP API").'
                        )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def create_app(settings: ServerSettings | None = None, *, engine: Engine | None = None) -> FastAPI:
    """Build the Orbit API.

    Args:
        settings: configuration; ``None`` reads it from ``ORBIT_*`` environment variables.
        engine: an engine to use (not disposed by the app); ``None`` builds one from
            ``settings.database_url`` for the app's lifetime. The schema must already
            be migrated (``orbit-server migrate``; ``serve`` does it for SQLite).
    """
    settings = settings or ServerSettings()
    owns_engine = engine is None
    the_engine = engine or create_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        ping_idle_seconds=settings.db_ping_idle_seconds,
    )
    key_ttl = timedelta(seconds=settings.submission_key_ttl_seconds)
    server_info = ServerInfo(
        submission_key_ttl_seconds=settings.submission_key_ttl_seconds,
        max_batch_items=settings.max_batch_items,
        max_body_bytes=settings.max_body_bytes,
    )
    wakeup = Wakeup()

    def sweep_all() -> int:
        """Run the expiry sweep until a pass finds less than a full batch (DESIGN §4)."""
        total = 0
        while True:
            changed = transact(the_engine, leasing.expire_leases, limit=200)
            total += changed
            if changed < 200:
                return total

    async def sweep_forever(interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                if await run_in_threadpool(sweep_all):
                    wakeup.notify()
            except Exception:
                log.exception("the lease expiry sweep failed; it runs again in %s s", interval)

    def sample_once() -> None:
        with the_engine.connect() as conn:
            metrics.sampled.store(sample_gauges(conn))

    async def sample_forever(interval: float) -> None:
        failing = False
        while True:
            try:
                await run_in_threadpool(sample_once)
                failing = False
            except Exception:
                metrics.sampled.failures.inc()
                if not failing:
                    log.exception("sampling the /metrics gauges failed; it runs again every %s s", interval)
                failing = True
            await asyncio.sleep(interval)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        wakeup.bind(asyncio.get_running_loop())
        sampler = None
        if settings.metrics_sample_interval_seconds > 0:
            sampler = asyncio.create_task(
                sample_forever(settings.metrics_sample_interval_seconds), name="orbit-metrics-sampler"
            )
        sweeper = None
        if settings.sweep_interval_seconds > 0:
            sweeper = asyncio.create_task(
                sweep_forever(settings.sweep_interval_seconds), name="orbit-expiry-sweep"
            )
        scheduler = None
        if settings.scheduler_interval_seconds > 0:
            scheduler = asyncio.create_task(
                run_scheduler(the_engine, settings, wakeup.notify), name="orbit-scheduler"
            )
        flow_loop = None
        if settings.flow_interval_seconds > 0:
            flow_loop = asyncio.create_task(
                run_flow_loop(the_engine, settings, wakeup.notify), name="orbit-flow-loop"
            )
        try:
            yield
        finally:
            if flow_loop is not None:
                flow_loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flow_loop
            if scheduler is not None:
                scheduler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scheduler
            if sweeper is not None:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            if owns_engine:
                the_engine.dispose()

    app = FastAPI(
        title="Orbit",
        version="0.1.0",
        summary="Idempotent task acceptance and execution",
        lifespan=lifespan,
    )
    app.state.engine = the_engine
    metrics = Metrics()
    app.state.key_cache = KeyCache(settings.api_key_cache_seconds)
    app.state.settings = settings
    app.state.wakeup = wakeup

    # ------------------------------------------------------------ error bodies

    @app.exception_handler(errors.OrbitServerError)
    async def _domain_error(request: Request, exc: errors.OrbitServerError) -> JSONResponse:
        response = problem_response(
            exc.status, exc.code, exc.title, exc.detail, _request_id(request), **exc.extra
        )
        response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Report where and why, never the offending input (it may hold params). A validator's own
        # message (e.g. "node 'a': next 'b' is not a node of the graph") loses pydantic's prefix.
        problems = [
            {
                "loc": list(e.get("loc", ())),
                "msg": e.get("msg", "").removeprefix("Value error, "),
                "type": e.get("type", ""),
            }
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
        return problem_response(
            422, "validation_error", "The request is not valid", detail, _request_id(request), errors=problems
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None) or _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        detail = str(exc.detail)
        if exc.status_code == 400 and (unreadable := _unreadable_body(exc.__cause__)) is not None:
            code, detail = unreadable
        response = problem_response(exc.status_code, code, code.replace("_", " ").capitalize(), detail,
                                    _request_id(request))  # fmt: skip
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    # ------------------------------------------------------------------ routes

    @app.get("/healthz", tags=["operations"])
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses={503: _PROBLEMS[400]})
    def readyz(request: Request) -> Any:
        """Readiness: the database answers a query."""
        try:
            with the_engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except sa.exc.SQLAlchemyError as exc:
            log.warning("readiness check failed: %s", type(exc).__name__)
            return problem_response(503, "database_unavailable", "Database unavailable",
                                    "the server cannot reach its database", _request_id(request))  # fmt: skip
        return {"status": "ok"}

    @app.get("/v1/settings", response_model=ServerInfo, tags=["operations"], responses=_PROBLEMS)
    def published_settings(caller: Caller) -> ServerInfo:
        """The settings clients and relays depend on, e.g. the key window (README "Retention and the key window").

        Any valid API key may read it, whatever its role.
        """
        return server_info

    @app.post(
        "/v1/namespaces/{namespace}/tasks",
        status_code=201,
        response_model=Task,
        tags=["tasks"],
        responses={
            **_PROBLEMS,
            200: {"model": Task, "description": "Replay of an earlier submission"},
            409: _PROBLEMS[400],
            410: _PROBLEMS[400],
            413: _PROBLEMS[400],
        },
    )
    def submit_task(
        namespace: NamespaceName,
        submission: TaskSubmission,
        caller: Caller,
        request: Request,
        response: Response,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
        traceparent: Annotated[
            str | None, Header(description='W3C Trace Context of the task (README "Tracing")')
        ] = None,
        tracestate: Annotated[str | None, Header(description="W3C tracestate beside traceparent")] = None,
    ) -> Task:
        """Accept a task once per ``(namespace, Idempotency-Key)``.

        201 with the new task; 200 with the original task and
        ``Idempotent-Replayed: true`` for a repeat; 422 ``idempotency_key_reused``
        when the key was used for another request; 409 ``request_in_progress`` while
        the key's first request is still running (IETF Idempotency-Key draft).
        """
        authorize(caller, namespace, "submit")
        if idempotency_key is None or idempotency_key == "":
            raise errors.IdempotencyKeyMissing("send a unique Idempotency-Key header with every submission")
        if not is_valid_idempotency_key(idempotency_key):
            raise errors.IdempotencyKeyInvalid("an Idempotency-Key is 1 to 255 printable ASCII characters")
        if len(request.headers.getlist("idempotency-key")) > 1:
            raise errors.IdempotencyKeyInvalid("send exactly one Idempotency-Key header")
        traceparent, tracestate = _tracing.clean(traceparent, tracestate) if traceparent else (None, None)
        span = server_tracing.accept_span(
            namespace, submission.queue, submission.handler, traceparent, tracestate
        )
        with _tracing.use_span(span):
            task, replayed = store.submit_task(
                the_engine,
                caller,
                submission,
                idempotency_key,
                default_max_attempts=settings.default_max_attempts,
                key_ttl=key_ttl,
                traceparent=traceparent,
                tracestate=tracestate,
            )
            server_tracing.accepted(span, task, replayed)
        metrics.submissions.labels("replayed" if replayed else "created").inc()
        if replayed:
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
        else:
            wakeup.notify()
        response.headers["Location"] = f"/v1/namespaces/{namespace}/tasks/{task.id}"
        return task

    @app.get(
        "/v1/namespaces/{namespace}/tasks/{task_id}", response_model=Task, tags=["tasks"], responses=_PROBLEMS
    )
    def get_task(namespace: NamespaceName, task_id: str, caller: Caller) -> Task:
        """One task of the namespace; 404 ``task_not_found`` otherwise."""
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            task = store.get_task(conn, caller.namespace_id, task_id)
        if task is None:
            raise errors.TaskNotFound(f"no task {task_id!r} in namespace {namespace!r}")
        return task

    @app.get(
        "/v1/namespaces/{namespace}/submissions/{idempotency_key:path}",
        response_model=Task,
        tags=["tasks"],
        responses={**_PROBLEMS, 410: _PROBLEMS[400]},
    )
    def find_submission(namespace: NamespaceName, idempotency_key: str, caller: Caller) -> Task:
        """The task an idempotency key created; 404 ``submission_not_found`` if none.

        410 ``task_purged`` (with ``task_id``) when the key is remembered but its task was purged.

        This is how a relay or an operator settles an uncertain send (README "Using the client").
        """
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            task = store.find_submission(conn, caller.namespace_id, idempotency_key)
        if task is None:
            raise errors.SubmissionNotFound(f"no task was created with this idempotency key in {namespace!r}")
        return task

    @app.get(
        "/v1/namespaces/{namespace}/queues/{queue}",
        response_model=Queue,
        tags=["queues"],
        responses=_PROBLEMS,
    )
    def get_queue(
        namespace: NamespaceName, queue: Annotated[str, Path(pattern=NAME_PATTERN)], caller: Caller
    ) -> Queue:
        """A queue, its task count per status, its gate (``paused``) and concurrency limits; 404 ``queue_not_found``."""
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            found = store.get_queue(conn, namespace, caller.namespace_id, queue)
        if found is None:
            raise errors.QueueNotFound(f"queue {queue!r} does not exist in namespace {namespace!r}")
        return found

    # -------------------------------------------------------------- execution

    @app.get("/v1/namespaces/{namespace}/tasks", response_model=TaskPage, tags=["tasks"],
             responses={**_PROBLEMS})  # fmt: skip
    def list_tasks(
        namespace: NamespaceName,
        caller: Caller,
        status: TaskStatus | None = None,
        queue: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: Annotated[str | None, Query(max_length=512)] = None,
    ) -> TaskPage:
        """A page of the namespace's tasks, oldest first; filter by ``status`` and ``queue``.

        Pass ``next_cursor`` back as ``cursor`` for the next page; 400 ``invalid_cursor`` for
        a cursor this server did not produce.
        """
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            return store.list_tasks(
                conn, caller.namespace_id, status=status, queue=queue, limit=limit, cursor=cursor
            )

    @app.post(
        "/v1/namespaces/{namespace}/queues/{queue}/leases",
        response_model=list[LeaseGrant],
        tags=["execution"],
        responses=_PROBLEMS,
    )
    async def lease_tasks(
        namespace: NamespaceName, queue: QueueName, body: LeaseRequest, caller: Caller, request: Request
    ) -> Any:
        """Lease up to ``max_tasks`` due tasks for one worker (README "Workers").

        Each grant carries the task and a new attempt: id, ``generation`` (fencing number),
        the secret ``lease_token`` and ``lease_expires_at`` (database clock). An empty list when
        nothing is due after ``wait_seconds`` of long-polling. Expired leases of the queue are
        swept first. Requires the ``work`` role.
        """
        authorize(caller, namespace, "work")
        loop = asyncio.get_running_loop()
        give_up = loop.time() + body.wait_seconds
        while True:
            signal = wakeup.current()
            if await request.is_disconnected():
                return []  # the worker gave up waiting: granting now would strand the task until expiry
            started_ns = time.time_ns()
            grants = await run_in_threadpool(
                transact,
                the_engine,
                leasing.lease_tasks,
                caller.namespace_id,
                queue,
                worker_id=body.worker_id,
                max_tasks=body.max_tasks,
                lease_seconds=body.lease_seconds,
            )
            remaining = give_up - loop.time()
            if grants:
                metrics.lease_grants.labels(queue).inc(len(grants))
            if grants or remaining <= 0:
                if _tracing.AVAILABLE and grants:
                    server_tracing.lease_granted(started_ns, grants, body.worker_id)
                # Serialised once here, not validated again against response_model first.
                return Response(_LEASE_GRANTS.dump_json(grants), media_type="application/json")
            await wakeup.wait(signal, min(remaining, settings.lease_poll_interval_seconds))

    attempt_path = "/v1/namespaces/{namespace}/attempts/{attempt_id}"

    @app.post(f"{attempt_path}/start", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS)
    def start_attempt(
        namespace: NamespaceName, attempt_id: str, body: LeaseTokenRequest, caller: Caller
    ) -> AttemptState:
        """Confirm that the handler starts: ``LEASED → RUNNING``, lease renewed.

        409 ``lease_lost`` for a wrong token or an attempt that no longer holds the lease.
        Repeating it for a running attempt answers the same state. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        return transact(
            the_engine, attempt_reports.start_attempt, caller.namespace_id, attempt_id, body.lease_token
        )

    @app.post(
        f"{attempt_path}/heartbeat", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS
    )
    def heartbeat(
        namespace: NamespaceName, attempt_id: str, body: HeartbeatRequest, caller: Caller
    ) -> AttemptState:
        """Renew the lease; the answer says the new expiry and whether cancellation was requested.

        409 ``lease_lost`` for a wrong token or an attempt that no longer holds the lease.
        Requires ``work``.
        """
        authorize(caller, namespace, "work")
        return transact(
            the_engine,
            attempt_reports.heartbeat,
            caller.namespace_id,
            attempt_id,
            body.lease_token,
            lease_seconds=body.lease_seconds,
        )

    @app.post(
        f"{attempt_path}/complete", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS
    )
    def complete_attempt(
        namespace: NamespaceName, attempt_id: str, body: CompleteRequest, caller: Caller
    ) -> AttemptState:
        """Save the result: attempt and task ``SUCCEEDED``.

        409 ``lease_lost`` when the attempt no longer holds the lease; with the right token
        the result is kept on the attempt as evidence (``evidence_recorded``). 409
        ``invalid_transition`` before ``start``. The same body again answers 200. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        return transact(
            the_engine,
            attempt_reports.complete_attempt,
            caller.namespace_id,
            attempt_id,
            body.lease_token,
            body.result,
        )

    @app.post(f"{attempt_path}/fail", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS)
    def fail_attempt(
        namespace: NamespaceName, attempt_id: str, body: FailRequest, caller: Caller
    ) -> AttemptState:
        """Report a failure: the task waits for a retry, fails, or (after a cancel request) is cancelled.

        409 ``lease_lost`` as for ``complete``. The same body again answers 200. Requires ``work``.
        """
        authorize(caller, namespace, "work")
        state = transact(
            the_engine,
            attempt_reports.fail_attempt,
            caller.namespace_id,
            attempt_id,
            body.lease_token,
            body.error,
        )
        return state

    app.include_router(attempt_batch_router(the_engine))

    task_path = "/v1/namespaces/{namespace}/tasks/{task_id}"

    @app.post(f"{task_path}/cancel", response_model=Task, tags=["tasks"], responses=_CONFLICTS)
    def cancel_task(namespace: NamespaceName, task_id: str, body: CancelRequest, caller: Caller) -> Task:
        """Cancel a task: ``WAITING``/``LEASED`` at once; ``RUNNING`` once the worker reports it stopped.

        409 ``invalid_transition`` for a ``SUCCEEDED``, ``FAILED`` or ``NEEDS_REVIEW`` task.
        Requires ``admin``.
        """
        authorize(caller, namespace, "admin")
        return transact(
            the_engine,
            task_ops.cancel_task,
            caller.namespace_id,
            task_id,
            reason=body.reason,
            actor=f"api_key:{caller.key_id}",
        )

    @app.post(f"{task_path}/review", response_model=Task, tags=["tasks"], responses=_CONFLICTS)
    def review_task(namespace: NamespaceName, task_id: str, body: ReviewRequest, caller: Caller) -> Task:
        """Settle a ``NEEDS_REVIEW`` task as ``SUCCEEDED`` or ``FAILED``, audited with actor, reason, evidence.

        409 ``invalid_transition`` for any other state. Requires ``admin``.
        """
        authorize(caller, namespace, "admin")
        return transact(
            the_engine,
            task_ops.review_task,
            caller.namespace_id,
            task_id,
            outcome=body.outcome,
            reason=body.reason,
            evidence_ref=body.evidence_ref,
            result=body.result,
            actor=f"api_key:{caller.key_id}",
            on_behalf_of=body.actor,
        )

    @app.post(
        f"{task_path}/retry", response_model=Task, status_code=201, tags=["tasks"], responses=_CONFLICTS
    )
    def retry_task(
        namespace: NamespaceName, task_id: str, body: RetryRequest, caller: Caller, response: Response
    ) -> Task:
        """Create the one successor (``retry_of``) of a ``FAILED`` or ``CANCELLED`` task.

        409 ``successor_exists`` (with ``successor_id``) when it was retried already, 409
        ``not_retryable`` for another state. Requires ``admin``.
        """
        authorize(caller, namespace, "admin")
        task = transact(
            the_engine,
            task_ops.retry_task,
            caller.namespace_id,
            task_id,
            reason=body.reason,
            actor=f"api_key:{caller.key_id}",
            deadline=body.deadline,
        )
        wakeup.notify()
        response.headers["Location"] = f"/v1/namespaces/{namespace}/tasks/{task.id}"
        return task

    @app.get(f"{task_path}/attempts", response_model=list[Attempt], tags=["tasks"], responses=_PROBLEMS)
    def list_attempts(namespace: NamespaceName, task_id: str, caller: Caller) -> list[Attempt]:
        """The task's attempts, first generation first (tokens are never shown)."""
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            return task_ops.list_attempts(conn, caller.namespace_id, task_id)

    @app.get(f"{task_path}/events", response_model=list[TaskEvent], tags=["tasks"], responses=_PROBLEMS)
    def list_events(namespace: NamespaceName, task_id: str, caller: Caller) -> list[TaskEvent]:
        """The task's history (every transition and audited action), oldest first."""
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            return task_ops.list_events(conn, caller.namespace_id, task_id)

    # ---------------------------------------------------------- result events

    subscriptions_path = "/v1/namespaces/{namespace}/subscriptions"

    @app.post(
        subscriptions_path,
        status_code=201,
        response_model=Subscription,
        tags=["results"],
        responses={**_CONFLICTS, 200: {"model": Subscription, "description": "It existed already"}},
    )
    def create_subscription(
        namespace: NamespaceName, body: SubscriptionRequest, caller: Caller, response: Response
    ) -> Subscription:
        """Create a subscription to the namespace's result events (README "Result events"). Requires ``admin``.

        201 when created; 200 with the existing one when the name exists with the same queues;
        409 ``subscription_exists`` when it exists with other queues; 404 ``queue_not_found``
        for an unknown queue. It receives the events that occur from its creation on, never
        earlier ones; ``queues`` omitted or null means every queue.
        """
        authorize(caller, namespace, "admin")
        subscription, created = transact(
            the_engine, results.create_subscription, caller.namespace_id, namespace, body.name, body.queues
        )
        if not created:
            response.status_code = 200
        response.headers["Location"] = f"/v1/namespaces/{namespace}/subscriptions/{subscription.name}"
        return subscription

    @app.get(
        f"{subscriptions_path}/{{name}}", response_model=Subscription, tags=["results"], responses=_PROBLEMS
    )
    def get_subscription(namespace: NamespaceName, name: SubscriptionName, caller: Caller) -> Subscription:
        """One subscription; 404 ``subscription_not_found``."""
        authorize(caller, namespace, "read")
        with the_engine.begin() as conn:
            return results.get_subscription(conn, caller.namespace_id, namespace, name)

    @app.post(
        f"{subscriptions_path}/{{name}}/deliveries/lease",
        response_model=list[Delivery],
        tags=["results"],
        responses=_CONFLICTS,
    )
    def lease_deliveries(
        namespace: NamespaceName, name: SubscriptionName, body: DeliveryLeaseRequest, caller: Caller
    ) -> list[Delivery]:
        """Lease up to ``max`` unacked deliveries of the subscription, oldest first. Requires ``work``.

        Each is ``{id, subscription, delivery_count, lease_expires_at, event}``. A delivery not
        acked within ``lease_seconds`` (database clock) is handed out again, with a higher
        ``delivery_count``: delivery is at least once, so receivers dedupe by ``event.id``
        (§6.2 of the reliability model). An empty list when none is due; never waits.
        """
        authorize(caller, namespace, "work")
        return transact(
            the_engine,
            results.lease_deliveries,
            caller.namespace_id,
            namespace,
            name,
            max_deliveries=body.max,
            lease_seconds=body.lease_seconds,
            leased_by=f"api_key:{caller.key_id}",
        )

    @app.post(
        f"{subscriptions_path}/{{name}}/deliveries/{{delivery_id}}/ack",
        response_model=DeliveryAck,
        tags=["results"],
        responses=_PROBLEMS,
    )
    def ack_delivery(
        namespace: NamespaceName, name: SubscriptionName, delivery_id: str, caller: Caller
    ) -> DeliveryAck:
        """Acknowledge a delivery: it is never handed out again. Requires ``work``.

        Send it only once the event's effect is committed. Idempotent: acking again answers 200
        with the first ``acked_at``. 404 ``delivery_not_found`` for an id not of this subscription.
        """
        authorize(caller, namespace, "work")
        return transact(the_engine, results.ack_delivery, caller.namespace_id, name, delivery_id)

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    def prometheus_metrics() -> Response:
        """Prometheus metrics (text exposition format); no API key, like /healthz: expose it internally."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(
        batch_router(engine=the_engine, settings=settings, metrics=metrics, on_created=wakeup.notify)
    )
    app.include_router(schedules_router(engine=the_engine))
    app.include_router(flows_router(engine_=the_engine, settings=settings, on_created=wakeup.notify))
    app.include_router(queues_router(engine=the_engine, on_resume=wakeup.notify))
    app.include_router(
        console_router(
            engine=the_engine, settings=settings, key_cache=app.state.key_cache, on_created=wakeup.notify
        )
    )
    _finish_openapi(app)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        body_timeout_seconds=settings.body_timeout_seconds,
        access_log=settings.access_log,
        redact=settings.access_log_redact,
    )
    return app
