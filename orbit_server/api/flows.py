"""Flow routes: ``/v1/namespaces/{ns}/flows`` and ``/v1/namespaces/{ns}/flow-instances`` (README "Flows:
running them").

A ``submit`` key may publish versions, start instances and send signals; any key of the namespace may
read; cancel, pause and resume need an ``admin`` key. Every change is audited in the instance's
history (``GET .../history``) or, for a publication, in the version (``published_at``/``published_by``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Body, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from sqlalchemy.engine import Engine

from orbit_client import (
    NAME_PATTERN,
    FlowControl,
    FlowHistoryPage,
    FlowInstance,
    FlowInstancePage,
    FlowInstanceStatus,
    FlowPublish,
    FlowSignal,
    FlowSignalRecord,
    FlowStart,
    FlowSummary,
    FlowVersion,
    Problem,
    _tracing,
    canonical_graph,
    check_json_data,
    is_valid_idempotency_key,
)
from orbit_server import errors
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import STRICT_QUERY
from orbit_server.db import flow_hooks
from orbit_server.db.engine import BIGINT_MAX
from orbit_server.db.transact import transact
from orbit_server.flows import control, engine
from orbit_server.flows import store as flow_store
from orbit_server.settings import ServerSettings
from orbit_server.tasks.store import Principal

__all__ = ["flows_router"]

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
FlowName = Annotated[str, Path(pattern=NAME_PATTERN, description="Flow name.")]
_PROBLEM: dict[str, Any] = {"model": Problem, "content": {"application/problem+json": {}}}
_ERRORS: dict[int | str, dict[str, Any]] = {status: _PROBLEM for status in (400, 401, 403, 404, 422)}
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {**_ERRORS, 409: _PROBLEM}
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]
#: The body of cancel, pause and resume: ``{"reason", "actor"}``, both optional; no body means ``{}``.
ControlBody = Annotated[FlowControl | None, Body()]


def _key(request: Request, key: str | None, what: str) -> str:
    if key is None or key == "":
        raise errors.IdempotencyKeyMissing(f"send a unique Idempotency-Key header with every {what}")
    if not is_valid_idempotency_key(key):
        raise errors.IdempotencyKeyInvalid("an Idempotency-Key is 1 to 255 printable ASCII characters")
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise errors.IdempotencyKeyInvalid("send exactly one Idempotency-Key header")
    return key


def flows_router(*, engine_: Engine, settings: ServerSettings, on_created: Callable[[], None]) -> APIRouter:
    """The flow routes over ``engine_``; ``on_created`` wakes this process's lease long-polls."""
    db = engine_
    router = APIRouter(prefix="/v1/namespaces/{namespace}", tags=["flows"])
    engine_settings = engine.EngineSettings(
        default_max_attempts=settings.default_max_attempts,
        key_ttl=timedelta(seconds=settings.submission_key_ttl_seconds),
        max_value_bytes=settings.max_body_bytes,
    )

    def created(outcome: engine.Outcome) -> None:
        if outcome.created_tasks:
            on_created()

    def instance(caller: Principal, instance_id: str) -> FlowInstance:
        with db.connect() as conn:
            return flow_store.get_instance(conn, caller, instance_id)

    # ------------------------------------------------------------------ definitions

    @router.post(
        "/flows/{name}/versions", response_model=FlowVersion, status_code=201,
        responses={**_WRITE_ERRORS, 200: {"model": FlowVersion, "description": "The same graph's existing version"}},
    )  # fmt: skip
    def publish_version(
        namespace: NamespaceName, name: FlowName, body: FlowPublish, caller: Caller, response: Response
    ) -> FlowVersion:
        """Publish a version of a flow graph (``submit`` key): 201 with the new, immutable version; 200
        with the existing version when the identical graph (same digest) was published before.
        ``422 validation_error`` names the node at fault."""
        authorize(caller, namespace, "submit")
        _check_stored_depth(body)
        try:
            version, new = transact(db, flow_store.publish, caller, name, body)
        except sa.exc.IntegrityError:  # a concurrent first publish of this flow (or of this graph) won
            version, new = transact(db, flow_store.publish, caller, name, body)
        if not new:
            response.status_code = 200
        return version

    @router.get("/flows", response_model=list[FlowSummary], responses=_ERRORS)
    def list_flows(namespace: NamespaceName, caller: Caller) -> list[FlowSummary]:
        """The namespace's flows, by name, with their newest version."""
        authorize(caller, namespace, "read")
        with db.connect() as conn:
            return flow_store.list_flows(conn, caller)

    @router.get("/flows/{name}/versions", response_model=list[FlowVersion], responses=_ERRORS)
    def list_versions(namespace: NamespaceName, name: FlowName, caller: Caller) -> list[FlowVersion]:
        """A flow's versions, newest first; ``404 flow_not_found``."""
        authorize(caller, namespace, "read")
        with db.connect() as conn:
            return flow_store.list_versions(conn, caller, name)

    @router.get("/flows/{name}/versions/{version}", response_model=FlowVersion, responses=_ERRORS)
    def get_version(
        namespace: NamespaceName,
        name: FlowName,
        version: Annotated[int, Path(ge=1, le=BIGINT_MAX)],
        caller: Caller,
    ) -> FlowVersion:
        """One version; ``404 flow_not_found`` / ``flow_version_not_found``."""
        authorize(caller, namespace, "read")
        with db.connect() as conn:
            return flow_store.get_version(conn, caller, name, version)

    # ------------------------------------------------------------------ instances

    @router.post(
        "/flows/{name}/instances", response_model=FlowInstance, status_code=201,
        responses={**_WRITE_ERRORS, 410: _PROBLEM,
                   200: {"model": FlowInstance, "description": "Replay of an earlier start"}},
    )  # fmt: skip
    def start_instance(
        namespace: NamespaceName, name: FlowName, body: FlowStart, caller: Caller, request: Request,
        response: Response, idempotency_key: IdempotencyKey = None,
        traceparent: Annotated[str | None, Header(description="W3C Trace Context")] = None,
    ) -> FlowInstance:  # fmt: skip
        """Start an instance of the newest (or the named) version, once per ``Idempotency-Key`` (``submit``).

        201 with the new instance; 200 with the original one (``Idempotent-Replayed: true``) for the
        same key and request; ``409 idempotency_conflict`` for the same key and another request;
        ``410 flow_instance_purged`` (with ``instance_id``) when the key's instance finished and was purged
        (its tombstone lives for the key window); ``404 flow_not_found`` / ``flow_version_not_found``.
        """
        authorize(caller, namespace, "submit")
        key = _key(request, idempotency_key, "start")
        traceparent = _tracing.clean(traceparent, None)[0] if traceparent else None
        try:
            instance_id, replayed, outcome = transact(
                db, flow_store.start, caller, name, body, key, engine_settings, traceparent=traceparent
            )
        except sa.exc.IntegrityError:  # a concurrent start with this key committed first
            with db.connect() as conn:
                found = flow_store.find_start(conn, caller, key, flow_store.start_digest(name, body))
            if found is None:
                raise errors.RequestInProgress(
                    "another start with this Idempotency-Key is being processed; retry shortly"
                ) from None
            instance_id, replayed, outcome = found, True, engine.Outcome("none")
        created(outcome)
        if replayed:
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
        response.headers["Location"] = f"/v1/namespaces/{namespace}/flow-instances/{instance_id}"
        return instance(caller, instance_id)

    @router.get(
        "/flow-instances", response_model=FlowInstancePage, responses=_ERRORS, dependencies=STRICT_QUERY
    )
    def list_instances(
        namespace: NamespaceName, caller: Caller,
        flow: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        status: FlowInstanceStatus | None = None,
        idempotency_key: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
        cursor: str | None = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> FlowInstancePage:  # fmt: skip
        """The namespace's instances, newest first, with their tokens and steps; filters ``flow``,
        ``status``, ``idempotency_key``; ``next_cursor`` pages on."""
        authorize(caller, namespace, "read")
        with db.connect() as conn:
            return flow_store.list_instances(
                conn,
                caller,
                flow=flow,
                status=status,
                idempotency_key=idempotency_key,
                cursor=cursor,
                limit=limit,
            )

    @router.get("/flow-instances/{instance_id}", response_model=FlowInstance, responses=_ERRORS)
    def get_instance(namespace: NamespaceName, instance_id: str, caller: Caller) -> FlowInstance:
        """One instance: status, tokens (what each waits for), steps (their tasks' status and result) and
        ``pending_events`` (task results recorded, not yet applied); ``404 flow_instance_not_found``."""
        authorize(caller, namespace, "read")
        return instance(caller, instance_id)

    @router.get(
        "/flow-instances/{instance_id}/history",
        response_model=FlowHistoryPage,
        responses=_ERRORS,
        dependencies=STRICT_QUERY,
    )
    def get_history(
        namespace: NamespaceName, instance_id: str, caller: Caller, cursor: str | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> FlowHistoryPage:  # fmt: skip
        """Every change of the instance and its tokens, oldest first (``next_cursor`` pages on)."""
        authorize(caller, namespace, "read")
        with db.connect() as conn:
            return flow_store.history(conn, caller, instance_id, cursor=cursor, limit=limit)

    def controlled(
        work: Callable[..., None],
        namespace: str,
        instance_id: str,
        body: FlowControl | None,
        caller: Principal,
    ) -> FlowInstance:
        authorize(caller, namespace, "admin")
        transact(db, work, caller, instance_id, body or FlowControl(), engine_settings)
        return instance(caller, instance_id)

    @router.post("/flow-instances/{instance_id}/cancel", response_model=FlowInstance, responses=_WRITE_ERRORS)
    def cancel_instance(
        namespace: NamespaceName, instance_id: str, caller: Caller, body: ControlBody = None
    ) -> FlowInstance:
        """Cancel (``admin``): the instance, its tokens and timers ``CANCELLED``, its live step tasks asked
        to stop; ``409 invalid_transition`` when it is finished."""
        return controlled(control.cancel, namespace, instance_id, body, caller)

    @router.post("/flow-instances/{instance_id}/pause", response_model=FlowInstance, responses=_WRITE_ERRORS)
    def pause_instance(
        namespace: NamespaceName, instance_id: str, caller: Caller, body: ControlBody = None
    ) -> FlowInstance:
        """Pause (``admin``; idempotent): no new task, timer or poll round; results in flight are recorded
        and applied on resume. ``409 invalid_transition`` when it is finished."""
        return controlled(control.pause, namespace, instance_id, body, caller)

    @router.post("/flow-instances/{instance_id}/resume", response_model=FlowInstance, responses=_WRITE_ERRORS)
    def resume_instance(
        namespace: NamespaceName, instance_id: str, caller: Caller, body: ControlBody = None
    ) -> FlowInstance:
        """Resume (``admin``; idempotent): pending results, due timers and buffered signals are applied."""
        result = controlled(control.resume, namespace, instance_id, body, caller)
        # Buffered signals whose waits can now take them (the loop's periodic scan is the fallback).
        with db.connect() as conn:
            waits = control.waiting_signal_tokens(conn, instance_id)
        moved = False
        for token_id in waits:
            outcome = transact(db, engine.match_signal, token_id, engine_settings)
            created(outcome)
            moved = moved or outcome.outcome == "applied"
        flow_hooks.notify()
        return instance(caller, instance_id) if moved else result

    @router.post(
        "/flow-instances/{instance_id}/signals", response_model=FlowSignalRecord, status_code=201,
        responses={**_WRITE_ERRORS, 200: {"model": FlowSignalRecord, "description": "Replay of an earlier signal"}},
    )  # fmt: skip
    def send_signal(
        namespace: NamespaceName, instance_id: str, body: FlowSignal, caller: Caller, request: Request,
        response: Response, idempotency_key: IdempotencyKey = None,
    ) -> FlowSignalRecord:  # fmt: skip
        """Send a signal (``submit``); the ``Idempotency-Key`` is its identity: 201 new, 200 replay, ``409
        idempotency_conflict`` for another name or payload, ``409 invalid_transition`` when the instance is
        finished. A signal no wait takes yet is buffered for the first matching wait."""
        authorize(caller, namespace, "submit")
        key = _key(request, idempotency_key, "signal")
        try:
            record, replayed, outcome = transact(
                db, control.signal, caller, instance_id, body, key, engine_settings
            )
        except sa.exc.IntegrityError:  # a concurrent signal with this identity committed first
            record, replayed, outcome = transact(
                db, control.signal, caller, instance_id, body, key, engine_settings
            )
        created(outcome)
        if replayed:
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
        return record

    return router


def _check_stored_depth(body: FlowPublish) -> None:
    """One depth rule on every database: the graph as stored (its canonical form) may nest at most
    ``JSON_MAX_DEPTH`` levels counted from its root, as MySQL/MariaDB count the document's depth; a
    template inside a node starts 3 levels down (graph, nodes, node). SQLite took deeper graphs and
    MariaDB refused them with a 500 (CHECK constraint).

    Raises:
        RequestValidationError: answered ``422 validation_error`` naming the limit.
    """
    try:
        check_json_data(canonical_graph(body.graph))
    except ValueError as exc:
        raise RequestValidationError(
            [{"loc": ("body", "graph"), "msg": f"the graph as stored (a node's templates 3 levels "
              f"below its root): {exc}", "type": "value_error"}]
        ) from None  # fmt: skip
