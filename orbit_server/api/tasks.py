"""Task endpoints: submit (idempotent), read, find by idempotency key, list, cancel, review, manual retry, history
(README "HTTP API").
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from orbit_client import (
    NAME_PATTERN,
    Attempt,
    CancelRequest,
    RetryRequest,
    ReviewRequest,
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
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import (
    _CONFLICTS,
    _PROBLEMS,
    STRICT_QUERY,
    EngineDep,
    MetricsDep,
    NamespaceName,
    SettingsDep,
    WakeupDep,
)
from orbit_server.db.cluster import causal_reads, is_galera
from orbit_server.db.transact import transact
from orbit_server.tasks import operations as task_ops
from orbit_server.tasks import store

__all__ = ["router"]

log = logging.getLogger("orbit_server.app")

router = APIRouter()
task_path = "/v1/namespaces/{namespace}/tasks/{task_id}"


@router.post(
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
    engine: EngineDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    metrics: MetricsDep,
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
            engine,
            caller,
            submission,
            idempotency_key,
            default_max_attempts=settings.default_max_attempts,
            key_ttl=timedelta(seconds=settings.submission_key_ttl_seconds),
            traceparent=traceparent,
            tracestate=tracestate,
        )
        server_tracing.accepted(span, task, replayed)
    metrics.submissions.labels("replayed" if replayed else "created").inc()
    if replayed:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    else:
        wakeup.notify((caller.namespace_id, submission.queue))
    response.headers["Location"] = f"/v1/namespaces/{namespace}/tasks/{task.id}"
    return task


@router.get(
    "/v1/namespaces/{namespace}/tasks/{task_id}", response_model=Task, tags=["tasks"], responses=_PROBLEMS
)
def get_task(engine: EngineDep, namespace: NamespaceName, task_id: str, caller: Caller) -> Task:
    """One task of the namespace; 404 ``task_not_found`` otherwise."""
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        task = store.get_task(conn, caller.namespace_id, task_id)
    if task is None:
        raise errors.TaskNotFound(f"no task {task_id!r} in namespace {namespace!r}")
    return task


@router.get(
    "/v1/namespaces/{namespace}/submissions/{idempotency_key:path}",
    response_model=Task,
    tags=["tasks"],
    responses={**_PROBLEMS, 410: _PROBLEMS[400]},
)
def find_submission(
    engine: EngineDep, namespace: NamespaceName, idempotency_key: str, caller: Caller
) -> Task:
    """The task an idempotency key created; 404 ``submission_not_found`` if none.

    410 ``task_purged`` (with ``task_id``) when the key is remembered but its task was purged.

    This is how a relay or an operator settles an uncertain send (README "Using the client").
    """
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        task = store.find_submission(conn, caller.namespace_id, idempotency_key)
        again = task is None and is_galera(conn)
    if again:  # reconcile decides on this answer: "not found" only once this node has caught up
        with engine.begin() as conn, causal_reads(conn):
            task = store.find_submission(conn, caller.namespace_id, idempotency_key)
    if task is None:
        raise errors.SubmissionNotFound(f"no task was created with this idempotency key in {namespace!r}")
    return task


@router.get("/v1/namespaces/{namespace}/tasks", response_model=TaskPage, tags=["tasks"],
         responses={**_PROBLEMS}, dependencies=STRICT_QUERY)  # fmt: skip
def list_tasks(
    engine: EngineDep,
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
    with engine.begin() as conn:
        return store.list_tasks(
            conn, caller.namespace_id, status=status, queue=queue, limit=limit, cursor=cursor
        )


@router.post(f"{task_path}/cancel", response_model=Task, tags=["tasks"], responses=_CONFLICTS)
def cancel_task(
    engine: EngineDep, namespace: NamespaceName, task_id: str, body: CancelRequest, caller: Caller
) -> Task:
    """Cancel a task: ``WAITING``/``LEASED`` at once; ``RUNNING`` once the worker reports it stopped.

    409 ``invalid_transition`` for a ``SUCCEEDED``, ``FAILED`` or ``NEEDS_REVIEW`` task.
    Requires ``admin``.
    """
    authorize(caller, namespace, "admin")
    return transact(
        engine,
        task_ops.cancel_task,
        caller.namespace_id,
        task_id,
        reason=body.reason,
        actor=f"api_key:{caller.key_id}",
    )


@router.post(f"{task_path}/review", response_model=Task, tags=["tasks"], responses=_CONFLICTS)
def review_task(
    engine: EngineDep, namespace: NamespaceName, task_id: str, body: ReviewRequest, caller: Caller
) -> Task:
    """Settle a ``NEEDS_REVIEW`` task as ``SUCCEEDED`` or ``FAILED``, audited with actor, reason, evidence.

    409 ``invalid_transition`` for any other state. Requires ``admin``.
    """
    authorize(caller, namespace, "admin")
    return transact(
        engine,
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


@router.post(f"{task_path}/retry", response_model=Task, status_code=201, tags=["tasks"], responses=_CONFLICTS)
def retry_task(
    engine: EngineDep,
    wakeup: WakeupDep,
    namespace: NamespaceName,
    task_id: str,
    body: RetryRequest,
    caller: Caller,
    response: Response,
) -> Task:
    """Create the one successor (``retry_of``) of a ``FAILED`` or ``CANCELLED`` task.

    409 ``successor_exists`` (with ``successor_id``) when it was retried already, 409
    ``not_retryable`` for another state. Requires ``admin``.
    """
    authorize(caller, namespace, "admin")
    task = transact(
        engine,
        task_ops.retry_task,
        caller.namespace_id,
        task_id,
        reason=body.reason,
        actor=f"api_key:{caller.key_id}",
        deadline=body.deadline,
    )
    wakeup.notify((caller.namespace_id, task.queue))
    response.headers["Location"] = f"/v1/namespaces/{namespace}/tasks/{task.id}"
    return task


@router.get(f"{task_path}/attempts", response_model=list[Attempt], tags=["tasks"], responses=_PROBLEMS)
def list_attempts(engine: EngineDep, namespace: NamespaceName, task_id: str, caller: Caller) -> list[Attempt]:
    """The task's attempts, first generation first (tokens are never shown)."""
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        return task_ops.list_attempts(conn, caller.namespace_id, task_id)


@router.get(f"{task_path}/events", response_model=list[TaskEvent], tags=["tasks"], responses=_PROBLEMS)
def list_events(engine: EngineDep, namespace: NamespaceName, task_id: str, caller: Caller) -> list[TaskEvent]:
    """The task's history (every transition and audited action), oldest first."""
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        return task_ops.list_events(conn, caller.namespace_id, task_id)
