"""Execution endpoints: lease a queue's due tasks (long-polling) and report on an attempt: start, heartbeat,
complete, fail (README "Workers"). The batched twins are in :mod:`.attempt_batches`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import TypeAdapter
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from orbit_client import (
    AttemptState,
    BatchLease,
    CompleteRequest,
    FailRequest,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseTokenRequest,
    _tracing,
)
from orbit_server.api import tracing as server_tracing
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import (
    _CONFLICTS,
    _PROBLEMS,
    EngineDep,
    MetricsDep,
    NamespaceName,
    QueueName,
    SettingsDep,
    WakeupDep,
)
from orbit_server.api.metrics import Metrics
from orbit_server.db.transact import transact
from orbit_server.tasks import attempts as attempt_reports
from orbit_server.tasks import leases as leasing
from orbit_server.tasks.worker_sightings import sightings_for

__all__ = ["record_grants", "router"]

log = logging.getLogger("orbit_server.app")
#: The lease answer's body, serialised without a second validation (``lease_tasks``).
_LEASE_GRANTS = TypeAdapter(list[LeaseGrant])

router = APIRouter()


def record_grants(
    metrics: Metrics, engine: Engine, namespace: str, namespace_id: int, lease: BatchLease,
    grants: list[LeaseGrant], started_ns: int,
) -> None:  # fmt: skip
    """What a standalone lease call records, for a lease a report batch carried (report-and-lease):
    the grants counted in ``orbit_lease_grants``, an ``orbit.lease`` span per traced grant (from
    ``started_ns``), and the worker's liveness sighting on the queue."""
    if grants:
        metrics.lease_grants.labels(namespace, lease.queue).inc(len(grants))
        if _tracing.AVAILABLE:
            server_tracing.lease_granted(started_ns, grants, lease.worker_id)
    sightings = sightings_for(engine)
    if sightings.due(namespace_id, lease.queue, lease.worker_id):
        sightings.write(namespace_id, lease.queue, lease.worker_id)


attempt_path = "/v1/namespaces/{namespace}/attempts/{attempt_id}"


def _answer(state: AttemptState) -> Response:
    """An attempt call's answer, serialised once: FastAPI would first validate the model it was built
    from again against ``response_model`` (which stays declared, for the OpenAPI document)."""
    return Response(state.model_dump_json(), media_type="application/json")


@router.post(
    "/v1/namespaces/{namespace}/queues/{queue}/leases",
    response_model=list[LeaseGrant],
    tags=["execution"],
    responses=_PROBLEMS,
)
async def lease_tasks(
    engine: EngineDep,
    settings: SettingsDep,
    wakeup: WakeupDep,
    metrics: MetricsDep,
    namespace: NamespaceName,
    queue: QueueName,
    body: LeaseRequest,
    caller: Caller,
    request: Request,
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
    sighted = False
    while True:
        signal = wakeup.current((caller.namespace_id, queue))
        # After a wait, the worker may have given up: granting then would strand the task until its lease
        # lapses. Before the first try it has just sent the request (the check costs a receive).
        if sighted and await request.is_disconnected():
            return Response(b"[]", media_type="application/json")
        started_ns = time.time_ns()
        grants = await run_in_threadpool(
            leasing.lease,
            engine,
            caller.namespace_id,
            queue,
            worker_id=body.worker_id,
            max_tasks=body.max_tasks,
            lease_seconds=body.lease_seconds,
            start=body.start,
        )
        if not sighted:  # the queue exists (no 404): this worker is alive, task or not (console liveness)
            sighted = True
            sightings = sightings_for(engine)
            if sightings.due(caller.namespace_id, queue, body.worker_id):
                await run_in_threadpool(sightings.write, caller.namespace_id, queue, body.worker_id)
        remaining = give_up - loop.time()
        if grants:
            metrics.lease_grants.labels(namespace, queue).inc(len(grants))
        if grants or remaining <= 0:
            if _tracing.AVAILABLE and grants:
                server_tracing.lease_granted(started_ns, grants, body.worker_id)
            # Serialised once here, not validated again against response_model first.
            return Response(_LEASE_GRANTS.dump_json(grants), media_type="application/json")
        await wakeup.wait(signal, min(remaining, settings.lease_poll_interval_seconds))


@router.post(f"{attempt_path}/start", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS)
def start_attempt(
    engine: EngineDep, namespace: NamespaceName, attempt_id: str, body: LeaseTokenRequest, caller: Caller
) -> Response:
    """Confirm that the handler starts: ``LEASED → RUNNING``, lease renewed.

    409 ``lease_lost`` for a wrong token or an attempt that no longer holds the lease.
    Repeating it for a running attempt answers the same state. Requires ``work``.
    """
    authorize(caller, namespace, "work")
    return _answer(
        transact(engine, attempt_reports.start_attempt, caller.namespace_id, attempt_id, body.lease_token)
    )


@router.post(
    f"{attempt_path}/heartbeat", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS
)
def heartbeat(
    engine: EngineDep, namespace: NamespaceName, attempt_id: str, body: HeartbeatRequest, caller: Caller
) -> Response:
    """Renew the lease; the answer says the new expiry and whether cancellation was requested.

    409 ``lease_lost`` for a wrong token or an attempt that no longer holds the lease.
    Requires ``work``.
    """
    authorize(caller, namespace, "work")
    return _answer(
        transact(
            engine,
            attempt_reports.heartbeat,
            caller.namespace_id,
            attempt_id,
            body.lease_token,
            lease_seconds=body.lease_seconds,
        )
    )


@router.post(
    f"{attempt_path}/complete", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS
)
def complete_attempt(
    engine: EngineDep, namespace: NamespaceName, attempt_id: str, body: CompleteRequest, caller: Caller
) -> Response:
    """Save the result: attempt and task ``SUCCEEDED``.

    409 ``lease_lost`` when the attempt no longer holds the lease; with the right token
    the result is kept on the attempt as evidence (``evidence_recorded``). 409
    ``invalid_transition`` before ``start``. The same body again answers 200; another result after
    the attempt reported its outcome, 409 ``report_conflict``. Requires ``work``.
    """
    authorize(caller, namespace, "work")
    return _answer(
        transact(
            engine,
            attempt_reports.complete_attempt,
            caller.namespace_id,
            attempt_id,
            body.lease_token,
            body.result,
        )
    )


@router.post(f"{attempt_path}/fail", response_model=AttemptState, tags=["execution"], responses=_CONFLICTS)
def fail_attempt(
    engine: EngineDep, namespace: NamespaceName, attempt_id: str, body: FailRequest, caller: Caller
) -> Response:
    """Report a failure: the task waits for a retry, fails, or (after a cancel request) is cancelled.

    409 ``lease_lost`` and ``report_conflict`` as for ``complete``. The same body again answers 200.
    Requires ``work``.
    """
    authorize(caller, namespace, "work")
    state = transact(
        engine,
        attempt_reports.fail_attempt,
        caller.namespace_id,
        attempt_id,
        body.lease_token,
        body.error,
    )
    return _answer(state)
