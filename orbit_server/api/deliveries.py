"""Result-event endpoints: subscriptions, and leasing and acking their deliveries (README "Result events")."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response

from orbit_client import (
    Delivery,
    DeliveryAck,
    DeliveryLeaseRequest,
    Subscription,
    SubscriptionRequest,
)
from orbit_server.api.auth import Caller, authorize
from orbit_server.api.deps import (
    _CONFLICTS,
    _PROBLEMS,
    EngineDep,
    NamespaceName,
    SubscriptionName,
)
from orbit_server.db.transact import transact
from orbit_server.results import deliveries as results

__all__ = ["router"]

log = logging.getLogger("orbit_server.app")

router = APIRouter()
subscriptions_path = "/v1/namespaces/{namespace}/subscriptions"


@router.post(
    subscriptions_path,
    status_code=201,
    response_model=Subscription,
    tags=["results"],
    responses={**_CONFLICTS, 200: {"model": Subscription, "description": "It existed already"}},
)
def create_subscription(
    engine: EngineDep, namespace: NamespaceName, body: SubscriptionRequest, caller: Caller, response: Response
) -> Subscription:
    """Create a subscription to the namespace's result events (README "Result events"). Requires ``admin``.

    201 when created; 200 with the existing one when the name exists with the same queues;
    409 ``subscription_exists`` when it exists with other queues; 404 ``queue_not_found``
    for an unknown queue. It receives the events that occur from its creation on, never
    earlier ones; ``queues`` omitted or null means every queue.
    """
    authorize(caller, namespace, "admin")
    subscription, created = transact(
        engine, results.create_subscription, caller.namespace_id, namespace, body.name, body.queues
    )
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/namespaces/{namespace}/subscriptions/{subscription.name}"
    return subscription


@router.get(
    f"{subscriptions_path}/{{name}}", response_model=Subscription, tags=["results"], responses=_PROBLEMS
)
def get_subscription(
    engine: EngineDep, namespace: NamespaceName, name: SubscriptionName, caller: Caller
) -> Subscription:
    """One subscription; 404 ``subscription_not_found``."""
    authorize(caller, namespace, "read")
    with engine.begin() as conn:
        return results.get_subscription(conn, caller.namespace_id, namespace, name)


@router.post(
    f"{subscriptions_path}/{{name}}/deliveries/lease",
    response_model=list[Delivery],
    tags=["results"],
    responses=_CONFLICTS,
)
def lease_deliveries(
    engine: EngineDep,
    namespace: NamespaceName,
    name: SubscriptionName,
    body: DeliveryLeaseRequest,
    caller: Caller,
) -> list[Delivery]:
    """Lease up to ``max`` unacked deliveries of the subscription, oldest first. Requires ``work``.

    Each is ``{id, subscription, delivery_count, lease_expires_at, event}``. A delivery not
    acked within ``lease_seconds`` (database clock) is handed out again, with a higher
    ``delivery_count``: delivery is at least once, so receivers dedupe by ``event.id``
    (§6.2 of the reliability model). An empty list when none is due; never waits.
    """
    authorize(caller, namespace, "work")
    return transact(
        engine,
        results.lease_deliveries,
        caller.namespace_id,
        namespace,
        name,
        max_deliveries=body.max,
        lease_seconds=body.lease_seconds,
        leased_by=f"api_key:{caller.key_id}",
    )


@router.post(
    f"{subscriptions_path}/{{name}}/deliveries/{{delivery_id}}/ack",
    response_model=DeliveryAck,
    tags=["results"],
    responses=_PROBLEMS,
)
def ack_delivery(
    engine: EngineDep, namespace: NamespaceName, name: SubscriptionName, delivery_id: str, caller: Caller
) -> DeliveryAck:
    """Acknowledge a delivery: it is never handed out again. Requires ``work``.

    Send it only once the event's effect is committed. Idempotent: acking again answers 200
    with the first ``acked_at``. 404 ``delivery_not_found`` for an id not of this subscription.
    """
    authorize(caller, namespace, "work")
    return transact(engine, results.ack_delivery, caller.namespace_id, name, delivery_id)
