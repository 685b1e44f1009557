"""Queue control routes: ``PATCH /v1/namespaces/{ns}/queues/{queue}`` (limits) and
``POST .../queues/{queue}/pause`` | ``/resume`` (README "Concurrency limits and pausing a queue").

They need an ``admin`` key and are audited in ``queue_events`` (actor ``api_key:<id>``, the
person ``actor`` of the body, ``reason``, before and after). ``GET .../queues/{queue}`` (any
key) shows the gate and limits beside the task counts.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path
from sqlalchemy.engine import Engine

from orbit_client import (
    NAME_PATTERN,
    Problem,
    Queue,
    QueueControl,
    QueueUpdate,
)
from orbit_server import errors
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import _PROBLEMS, EngineDep, WakeupDep
from orbit_server.api.wakeup import Wakeup
from orbit_server.db.transact import transact
from orbit_server.tasks import permits, store

__all__ = ["control_router", "router"]

NamespaceName = Annotated[str, Path(pattern=NAME_PATTERN, description="Namespace name.")]
QueueName = Annotated[str, Path(pattern=NAME_PATTERN, description="Queue name.")]
_PROBLEM: dict[str, Any] = {"model": Problem, "content": {"application/problem+json": {}}}
_ERRORS: dict[int | str, dict[str, Any]] = {status: _PROBLEM for status in (401, 403, 404, 409, 422)}


#: The queue control routes; the read (:func:`get_queue`) is on :data:`router`.
control_router = APIRouter(prefix="/v1/namespaces/{namespace}/queues/{queue}", tags=["queues"])


@control_router.patch("", response_model=Queue, responses=_ERRORS)
def update_queue(
    engine: EngineDep,
    wakeup: WakeupDep,
    namespace: NamespaceName,
    queue: QueueName,
    body: QueueUpdate,
    caller: Caller,
) -> Queue:
    """Change the queue's ``max_concurrency_per_key`` / ``max_concurrency`` (``admin``).

    Only the fields given change; ``null`` removes a limit. Attempts in flight are never
    taken back: a lowered limit holds new grants until the key is under it. 404
    ``queue_not_found``; 422 ``validation_error`` for a body with neither field.
    """
    authorize(caller, namespace, "admin")
    changes: dict[str, int | None] = {
        name: getattr(body, name)
        for name in ("max_concurrency_per_key", "max_concurrency")
        if name in body.model_fields_set
    }
    found = transact(
        engine, permits.set_limits, caller.namespace_id, queue, changes, actor=f"api_key:{caller.key_id}",
        reason=body.reason, on_behalf_of=body.actor,
    )  # fmt: skip
    wakeup.notify((caller.namespace_id, queue))  # a raised limit may let waiting tasks through
    return found


def control(
    engine: Engine,
    wakeup: Wakeup,
    namespace: str,
    queue: str,
    body: QueueControl | None,
    caller: Caller,
    paused: bool,
) -> Queue:
    authorize(caller, namespace, "admin")
    body = body or QueueControl()
    found = transact(
        engine, permits.set_paused, caller.namespace_id, queue, paused=paused,
        actor=f"api_key:{caller.key_id}", reason=body.reason, on_behalf_of=body.actor,
    )  # fmt: skip
    if not paused:
        wakeup.notify((caller.namespace_id, queue))
    return found


@control_router.post("/pause", response_model=Queue, responses=_ERRORS)
def pause_queue(
    engine: EngineDep,
    wakeup: WakeupDep,
    namespace: NamespaceName,
    queue: QueueName,
    caller: Caller,
    body: Annotated[QueueControl | None, Body()] = None,
) -> Queue:
    """Pause the queue (``admin``): no new leases, no starts (a start is answered 409 ``lease_lost``
    with ``queue_paused: true`` and its lease given back). Attempts in flight still heartbeat,
    complete and fail, and their results are recorded and delivered. Pausing a paused queue
    changes nothing.
    """
    return control(engine, wakeup, namespace, queue, body, caller, True)


@control_router.post("/resume", response_model=Queue, responses=_ERRORS)
def resume_queue(
    engine: EngineDep,
    wakeup: WakeupDep,
    namespace: NamespaceName,
    queue: QueueName,
    caller: Caller,
    body: Annotated[QueueControl | None, Body()] = None,
) -> Queue:
    """Resume the queue (``admin``): leases and starts go on; waiting lease long-polls get tasks."""
    return control(engine, wakeup, namespace, queue, body, caller, False)


#: The read endpoint of a queue; :data:`control_router` holds the changes.
router = APIRouter()


@router.get(
    "/v1/namespaces/{namespace}/queues/{queue}",
    response_model=Queue,
    tags=["queues"],
    responses=_PROBLEMS,
)
def get_queue(
    engine: EngineDep,
    namespace: NamespaceName,
    queue: Annotated[str, Path(pattern=NAME_PATTERN)],
    caller: Caller,
) -> Queue:
    """A queue, its task count per status, its gate (``paused``) and concurrency limits; 404 ``queue_not_found``."""
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        found = store.get_queue(conn, namespace, caller.namespace_id, queue)
    if found is None:
        raise errors.QueueNotFound(f"queue {queue!r} does not exist in namespace {namespace!r}")
    return found
